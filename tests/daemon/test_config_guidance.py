"""What check-config and run say beyond "invalid": a config without a connection is
refused with what to add, a ``TELEGRAM_BOT_TOKEN`` a config file ignores is named, and a
mistyped key gets "did you mean"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prismd.cli._prismd import main
from prismd.daemon._config import ConfigError, load_config
from prismd.daemon._runnable import check_runnable, config_warnings

from .helpers import child_env

MODEL_ONLY = """
[agents.assistant]
kind = "echo"
"""

WEB = """
[[connections]]
id = "web"
kind = "webchat"
listen = "127.0.0.1:0"

[agents.echo]
kind = "echo"

[[grants]]
connection = "web"
actors = ["*"]
aliases = ["echo"]
"""


def test_check_config_refuses_a_config_without_a_connection(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "prismd.toml"
    path.write_text(MODEL_ONLY)
    assert main(["check-config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{path}: [[connections]]: no connection: ")
    assert '[[connections]] block with id = "web" and kind = "webchat"' in err
    assert "prismd init" in err
    assert len(err.splitlines()) == 1


def test_run_refuses_a_config_without_a_connection(tmp_path: Path) -> None:
    path = tmp_path / "prismd.toml"
    path.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n' + MODEL_ONLY)
    done = subprocess.run(
        [sys.executable, "-m", "prismd", "run", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=child_env(),
    )
    assert done.returncode == 1
    assert f"prismd: {path}: [[connections]]: no connection: " in done.stderr
    assert "ready" not in done.stderr


def test_an_ignored_telegram_token_is_named_at_check_config_and_run(tmp_path: Path) -> None:
    path = tmp_path / "prismd.toml"
    path.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n' + MODEL_ONLY)
    env = child_env(TELEGRAM_BOT_TOKEN="123456:secret-token")
    warning = (
        f"prismd: warning: TELEGRAM_BOT_TOKEN is set but {path} has no telegram connection,"
        ' so it is not used; add a [[connections]] block with kind = "telegram" and'
        ' token_env = "TELEGRAM_BOT_TOKEN" (prismd init --telegram writes one)'
    )
    for command in (["check-config", str(path)], ["run", "--config", str(path)]):
        done = subprocess.run(
            [sys.executable, "-m", "prismd", *command],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
            env=env,
        )
        assert done.returncode == 1  # and no connection at all
        assert done.stderr.splitlines()[0] == warning, done.stderr
        assert "secret-token" not in done.stderr
    # A config with a Telegram connection (whatever its token variable), or the built-in
    # defaults (which use the variable), draw no warning; nor does an unset variable.
    config = load_config(path)
    assert config_warnings(config, {"TELEGRAM_BOT_TOKEN": " "}) == []
    assert config_warnings(config, {"TELEGRAM_BOT_TOKEN": "x"}) != []
    assert config_warnings(load_config(None, env={}), {"TELEGRAM_BOT_TOKEN": "x"}) == []
    path.write_text(
        WEB + '\n[[connections]]\nid = "tg"\nkind = "telegram"\ntoken_env = "OTHER"\n'
        '[[grants]]\nconnection = "tg"\npairing = true\naliases = ["echo"]\n'
    )
    assert config_warnings(load_config(path), {"TELEGRAM_BOT_TOKEN": "x"}) == []


def test_a_config_with_a_connection_is_runnable(tmp_path: Path) -> None:
    path = tmp_path / "prismd.toml"
    path.write_text(WEB)
    check_runnable(load_config(path), env={})
    path.write_text(MODEL_ONLY)
    with pytest.raises(ConfigError) as info:
        check_runnable(load_config(path), env={})
    assert info.value.key == "[[connections]]"


@pytest.mark.parametrize(
    ("text", "key", "message"),
    [
        ("[stroe]\nurl = 'x'\n", "stroe", "unknown key; did you mean 'store'?"),
        ("[daemon]\nstate_dri = 'x'\n", "[daemon].state_dri", "did you mean 'state_dir'?"),
        ("[control]\nsockt = 'x'\n", "[control].sockt", "did you mean 'socket'?"),
        (
            WEB.replace('listen = "127.0.0.1:0"', 'listne = "127.0.0.1:0"'),
            "[[connections]][1].listne",
            "did you mean 'listen'?",
        ),
        (
            WEB.replace('kind = "webchat"', 'kind = "webchat"\ntoken_env = "X"'),
            "[[connections]][1].token_env",
            "did you mean 'access_token_env'?",
        ),
        (
            WEB.replace('actors = ["*"]', 'actors = ["*"]\nnotifcations = true'),
            "[[grants]][1].notifcations",
            "did you mean 'notifications'?",
        ),
        ("[limits]\nmax_route = 3\n", "[limits].max_route", "did you mean 'max_routes'?"),
        ("frobnicate = 1\n", "frobnicate", "unknown key"),
        (
            "[agents.a]\nkind = 'openai'\nbase_url = 'http://127.0.0.1:1/v1'\nmodel = 'm'\n"
            "api_key_evn = 'X'\n",
            "[agents.a].api_key_evn",
            "unknown option for agent kind 'openai'; did you mean 'api_key_env'?",
        ),
        (
            "[agents.a]\nkind = 'mock'\ndelay = 1\n",
            "[agents.a].delay",
            "unknown option for agent kind 'mock'; did you mean 'delay_ms'?",
        ),
    ],
)
def test_unknown_keys_suggest_the_closest_known_one(
    tmp_path: Path, text: str, key: str, message: str
) -> None:
    path = tmp_path / "prismd.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key
    assert info.value.message.endswith(message), info.value.message
    if "did you mean" not in message:
        assert info.value.message == "unknown key"
    assert str(info.value) == f"{path}: {key}: {info.value.message}"


NO_GRANT = """
[[connections]]
id = "web"
kind = "webchat"
listen = "127.0.0.1:0"
"""


@pytest.mark.parametrize(
    ("agents", "aliases"),
    [
        ('[agents.helper]\nkind = "echo"\n', 'aliases = ["helper"]'),
        ("", 'aliases = ["echo"] and [agents.echo] kind = "echo"'),
    ],
    ids=["an-agent", "no-agent"],
)
def test_a_connection_no_grant_names_is_warned_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], agents: str, aliases: str
) -> None:
    # Such a daemon starts and says ready, and refuses every message on that connection.
    path = tmp_path / "prismd.toml"
    path.write_text(NO_GRANT + agents)
    assert main(["check-config", str(path)]) == 0
    err = capsys.readouterr().err
    assert err == (
        "prismd: warning: connection 'web' has no [[grants]] entry, so every message on it is"
        ' refused; add one: [[grants]] connection = "web", actors = ["*"] (or pairing = true),'
        f" {aliases}\n"
    )
    path.write_text(WEB)
    assert config_warnings(load_config(path), env={}) == []


@pytest.mark.parametrize(
    ("old", "new", "key", "typo"),
    [
        ('connection = "web"', 'conection = "web"', "[[grants]][1].connection", "conection"),
        ('id = "web"', 'idd = "web"', "[[connections]][1].id", "idd"),
        ('kind = "webchat"', 'knd = "webchat"', "[[connections]][1].kind", "knd"),
    ],
)
def test_a_missing_required_key_names_its_likely_typo(
    tmp_path: Path, old: str, new: str, key: str, typo: str
) -> None:
    # The required key is read before the table's unknown keys are: "conection" was
    # answered "[[grants]][1].connection: is required" alone.
    path = tmp_path / "prismd.toml"
    path.write_text(WEB.replace(old, new, 1))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key
    assert info.value.message == f"is required (this table has {typo!r}: a typo of it?)"
    path.write_text(WEB.replace(old, "", 1))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert (info.value.key, info.value.message) == (key, "is required")


def test_run_outside_the_config_s_directory_names_its_relative_paths(tmp_path: Path) -> None:
    # `prismd run --config ~/bot/prismd.toml` from ~ made an empty journal in ~/var: the
    # paths of a file `prismd init` writes are relative to where prismd runs.
    home, elsewhere = tmp_path / "bot", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    path = home / "prismd.toml"
    # (an unset token: run stops at its checks, after the warnings, before opening anything)
    path.write_text(
        '[daemon]\nstate_dir = "var"\n[store]\nurl = "sqlite:///var/journal.sqlite"\n'
        + WEB
        + '[[connections]]\nid = "tg"\nkind = "telegram"\ntoken_env = "PRISMD_TEST_UNSET"\n'
        '[[grants]]\nconnection = "tg"\npairing = true\naliases = ["echo"]\n'
    )
    command = [sys.executable, "-m", "prismd", "run", "--config", str(path)]

    def run(cwd: Path) -> list[str]:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=60, cwd=cwd, env=child_env()
        )
        assert done.returncode == 1
        return done.stderr.splitlines()

    assert run(elsewhere)[0] == (
        f"prismd: warning: {path} names relative paths (var, var/journal.sqlite,"
        f" var/run/control.sock): they are relative to where prismd runs ({elsewhere}), not"
        f" to the file's directory ({home}), so this journal and state are not that"
        f" directory's; run prismd from {home}, or make them absolute"
    )
    assert not (elsewhere / "var").exists()
    assert not any("relative paths" in line for line in run(home))


def test_a_signal_account_without_its_socket_is_named() -> None:
    # The built-in defaults add Signal only with both variables; one alone was ignored.
    defaults = load_config(None, env={})
    assert config_warnings(defaults, {"SIGNAL_ACCOUNT": "+15550001111"}) == [
        "SIGNAL_ACCOUNT is set but SIGNAL_CLI_SOCKET is not, so no Signal connection is added;"
        " set SIGNAL_CLI_SOCKET to signal-cli's socket path (docs/signal.md)"
    ]
    assert config_warnings(defaults, {}) == []
