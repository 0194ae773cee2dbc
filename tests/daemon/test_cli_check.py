"""`prismd check-config` refuses what `prismd run` would refuse, and `run` refuses it the same
way before it opens anything: real files, real groups, real subprocesses."""

from __future__ import annotations

import grp
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

import prismd.daemon._config as config_module
from adapters import kinds
from prismd.daemon._config import ConfigError, load_config
from prismd.daemon._runnable import check_runnable

from .helpers import REPO

pytestmark = pytest.mark.slow  # real subprocesses, servers or a browser

SECRET = "0123456:SecretTokenValue-7f3a-abcdefghijklmnopqrstu"
MISSING_ENV = "PRISMD_CHECK_MISSING_7F3A"
MISSING_GROUP = "no-such-group-7f3a"


@attrs.frozen
class Case:
    """One config that parses but cannot run here; ``key`` and ``message`` of the refusal."""

    name: str
    key: str
    message: str
    connection: str = ""
    store: str = ""
    store_keys: str = ""
    control: str = ""
    agent: str = ""


CASES = [
    Case(
        "token_env unset",
        "[[connections]][2].token_env",
        f"environment variable {MISSING_ENV} is not set or empty",
        connection=f'kind = "telegram"\ntoken_env = "{MISSING_ENV}"',
    ),
    Case(
        "token_file missing",
        "[[connections]][2].token_file",
        "secret file tg-token-7f3a not found",
        connection='kind = "telegram"\ntoken_file = "tg-token-7f3a"',
    ),
    Case(
        "webhook secret unset",
        "[[connections]][2].webhook_secret_env",
        f"environment variable {MISSING_ENV} is not set or empty",
        connection=(
            'kind = "telegram"\ntoken_env = "PRISMD_CHECK_TOKEN"\nmode = "webhook"\n'
            f'webhook_listen = "127.0.0.1:0"\nwebhook_secret_env = "{MISSING_ENV}"'
        ),
    ),
    Case(
        "web chat access token unset",
        "[[connections]][2].access_token_env",
        f"environment variable {MISSING_ENV} is not set or empty",
        connection=f'kind = "webchat"\nlisten = "127.0.0.1:0"\naccess_token_env = "{MISSING_ENV}"',
    ),
    Case(
        "signal tcp not on loopback",
        "[[connections]][2].tcp",
        "must be a loopback address",
        connection='kind = "signal"\naccount = "+15550001111"\ntcp = "192.0.2.1:7583"',
    ),
    Case(
        "postgresql URL the store refuses",
        "[store].url",
        "postgresql URL: sslmode must be one of",
        store="postgresql://prismd@localhost/prismd?sslmode=sometimes",
    ),
    Case(
        "postgresql password unset",
        "[store].password_env",
        f"environment variable {MISSING_ENV} is not set or empty",
        store="postgresql://prismd@localhost/prismd",
        store_keys=f'password_env = "{MISSING_ENV}"',
    ),
    Case(
        "sqlite URL the store refuses",
        "[store].url",
        "sqlite URL must be sqlite:///relative or sqlite:////absolute",
        store="sqlite://relative.sqlite",
    ),
    Case(
        "factory module missing",
        "[agents.x].factory",
        "cannot import module 'no_such_module_7f3a'",
        agent="no_such_module_7f3a:make",
    ),
    Case(
        "factory attribute missing",
        "[agents.x].factory",
        "module 'tests.daemon.helpers' has no attribute 'no_such_factory'",
        agent="tests.daemon.helpers:no_such_factory",
    ),
    Case(
        "factory module raises on import",
        "[agents.x].factory",
        "cannot import module 'exploding_module_7f3a' (RuntimeError)",
        agent="exploding_module_7f3a:make",
    ),
    Case(
        "control group missing",
        "[control].group",
        f"no such group {MISSING_GROUP!r}",
        control=f'group = "{MISSING_GROUP}"',
    ),
]


def write(tmp_path: Path, case: Case | None = None, **fields: str) -> Path:
    """A config whose state, store and socket live in ``tmp_path`` (nothing exists yet)."""
    if case is not None:
        fields = {
            "connection": case.connection,
            "store": case.store,
            "store_keys": case.store_keys,
            "control": case.control,
            "agent": case.agent,
            **fields,
        }
    store = fields.get("store") or f"sqlite:///{tmp_path / 'state' / 'journal.sqlite'}"
    second = fields.get("connection") or 'kind = "webchat"\nlisten = "127.0.0.1:0"'
    agent = fields.get("agent")
    agents = f'[agents.x]\nkind = "python"\nfactory = "{agent}"\n' if agent else ""
    aliases = '["echo", "x"]' if agent else '["echo"]'
    path = tmp_path / "prismd.toml"
    path.write_text(
        f"""
[daemon]
state_dir = "{tmp_path / "state"}"
[store]
url = "{store}"
{fields.get("store_keys", "")}
[control]
socket = "{tmp_path / "run" / "control.sock"}"
{fields.get("control", "")}
[[connections]]
id = "web"
kind = "webchat"
listen = "127.0.0.1:0"
[[connections]]
id = "two"
{second}
[agents.echo]
kind = "echo"
{agents}
[[grants]]
connection = "web"
actors = ["*"]
aliases = {aliases}
[[grants]]
connection = "two"
pairing = true
aliases = ["echo"]
"""
    )
    # A module whose import raises with a text that must not be shown.
    (tmp_path / "exploding_module_7f3a.py").write_text(f"raise RuntimeError({SECRET!r})\n")
    return path


def env_for(tmp_path: Path, **extra: str) -> dict[str, str]:
    drop = {MISSING_ENV, "CREDENTIALS_DIRECTORY", "NOTIFY_SOCKET", "WATCHDOG_USEC"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join((str(REPO), str(tmp_path)))
    env["PRISMD_CHECK_TOKEN"] = SECRET
    env.update(extra)
    return env


def prismd(tmp_path: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prismd", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=str(tmp_path),
        check=False,
    )


def nothing_started(tmp_path: Path) -> None:
    assert not (tmp_path / "state").exists(), "the state directory (and store) was opened"
    assert not (tmp_path / "run").exists(), "the control socket was created"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_check_config_refuses_naming_the_file_and_key(tmp_path: Path, case: Case) -> None:
    path = write(tmp_path, case)
    done = prismd(tmp_path, "check-config", "--config", str(path), env=env_for(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout == ""
    assert done.stderr.startswith(f"{path}: {case.key}: {case.message}"), done.stderr
    assert done.stderr.count("\n") == 1
    assert SECRET not in done.stderr and "pw-7f3a" not in done.stderr
    nothing_started(tmp_path)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_run_refuses_the_same_way_before_opening_anything(tmp_path: Path, case: Case) -> None:
    path = write(tmp_path, case)
    done = prismd(tmp_path, "run", "--config", str(path), env=env_for(tmp_path))
    assert done.returncode == 1, done.stderr
    # One line, printed once (not also as a log record), the same text check-config prints.
    assert done.stderr.startswith(f"prismd: {path}: {case.key}: {case.message}"), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert SECRET not in done.stderr and "pw-7f3a" not in done.stderr
    nothing_started(tmp_path)


def test_a_config_that_can_run_passes_and_nothing_is_started(tmp_path: Path) -> None:
    """Secrets present (a token file found through $CREDENTIALS_DIRECTORY, as under
    systemd), an existing group, an importable factory that is not called (it raises)."""
    credentials = tmp_path / "credentials"
    credentials.mkdir()
    (credentials / "tg-token-7f3a").write_text(SECRET + "\n")
    group = grp.getgrgid(os.getgid()).gr_name
    path = write(
        tmp_path,
        connection='kind = "telegram"\ntoken_file = "tg-token-7f3a"',
        control=f'group = "{group}"',
        agent="tests.daemon.helpers:failing_factory",
    )
    env = env_for(tmp_path, CREDENTIALS_DIRECTORY=str(credentials))
    done = prismd(tmp_path, "check-config", str(path), env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"ok: {path}: connections: webchat web, telegram two")
    assert SECRET not in done.stdout + done.stderr
    nothing_started(tmp_path)
    # Without the credentials directory the same file is refused, saying where it looked.
    done = prismd(tmp_path, "check-config", str(path), env=env_for(tmp_path))
    assert done.returncode == 1
    assert "[[connections]][2].token_file: secret file tg-token-7f3a not found" in done.stderr
    assert "$CREDENTIALS_DIRECTORY is not set" in done.stderr


def test_check_config_accepts_a_postgres_store_without_contacting_it(tmp_path: Path) -> None:
    """The URL's shape and the password source are checked; the server (a closed port
    here) is not contacted, so the check passes at once."""
    (tmp_path / "pg-password").write_text("pw-7f3a\n")
    path = write(
        tmp_path,
        store="postgres://prismd@127.0.0.1:1/prismd?schema=team",
        store_keys='password_file = "pg-password"\npool_size = 3',
    )
    done = prismd(tmp_path, "check-config", str(path), env=env_for(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "store: postgres" in done.stdout and "pw-7f3a" not in done.stdout + done.stderr
    nothing_started(tmp_path)


def test_check_config_takes_the_path_once(tmp_path: Path) -> None:
    path = write(tmp_path)
    env = env_for(tmp_path)
    same = prismd(tmp_path, "check-config", str(path), "--config", str(path), env=env)
    assert same.returncode == 0, same.stderr
    other = prismd(tmp_path, "check-config", str(path), "--config", "other.toml", env=env)
    assert other.returncode == 2
    assert "give the file once" in other.stderr


def test_availability_is_one_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection kind or store scheme is runnable by its entry in one table, nothing else."""
    signal = 'kind = "signal"\naccount = "+15550001111"\ntcp = "127.0.0.1:7583"'
    config = load_config(write(tmp_path, connection=signal), env={})
    check_runnable(config, env={})
    # Availability lives with the kind (adapters.kinds): a kind is built once it has a builder.
    unbuilt = attrs.evolve(kinds.CONNECTION_KINDS["signal"], build=None)
    monkeypatch.setattr(kinds, "CONNECTION_KINDS", {**kinds.CONNECTION_KINDS, "signal": unbuilt})
    with pytest.raises(ConfigError, match="not available in this build yet") as info:
        check_runnable(config, env={})
    assert info.value.key == "[[connections]][2].kind"

    # PostgreSQL is built: its entry is on, and turning it off is all that refuses it.
    config = load_config(write(tmp_path, store="postgresql://prismd@localhost/prismd"), env={})
    check_runnable(config, env={})
    monkeypatch.setattr(
        config_module, "STORE_SCHEMES", {**config_module.STORE_SCHEMES, "postgresql": False}
    )
    with pytest.raises(ConfigError, match="not available in this build yet"):
        check_runnable(config, env={})
    # Every kind the config format knows is in the table (a new kind cannot skip it).
    assert set(kinds.CONNECTION_KINDS) == {"telegram", "signal", "webchat", "discord"}
