"""``prismd doctor``: every live check against loopback fakes and the real PostgreSQL, a
broken setup with each broken piece named, nothing changed, no secret shown."""

from __future__ import annotations

import datetime as dt
import os
import socket
import sys
from pathlib import Path

import pytest
import trio

from prismd.cli import _doctor as doctor
from prismd.cli._doctor import _clock, diagnose
from prismd.cli._finding import Finding
from stores import migrate_store
from stores.postgres._schema import LATEST
from tests.fakes.openai_api import start_fake_openai
from tests.fakes.telegram_api import start_fake
from tests.support import pgserver

from .helpers import child_env, free_port, running_daemon, write_config

DEADLINE = 60
KEY = "sk-test-FAKE-KEY-0123456789abcdef"


def _config(
    tmp_path: Path,
    *,
    store: str,
    web_port: int,
    tg_origin: str,
    model_url: str,
    state_dir: str | None = None,
    socket_path: str | None = None,
    extra: str = "",
) -> Path:
    path = tmp_path / "prismd.toml"
    path.write_text(
        f"""
[daemon]
state_dir = "{state_dir or tmp_path / "state"}"

[store]
url = "{store}"

[control]
socket = "{socket_path or tmp_path / "run" / "control.sock"}"

[[connections]]
id = "web"
kind = "webchat"
listen = "127.0.0.1:{web_port}"

[[connections]]
id = "tg-main"
kind = "telegram"
token_env = "TG_TOKEN"
api_origin = "{tg_origin}"

[agents.assistant]
kind = "openai"
base_url = "{model_url}"
model = "gpt-4o-mini"
api_key_env = "MODEL_KEY"

[[grants]]
connection = "web"
actors = ["*"]
aliases = ["assistant"]

[[grants]]
connection = "tg-main"
pairing = true
aliases = ["assistant"]
{extra}
"""
    )
    return path


def _by_component(findings: list[Finding]) -> dict[str, Finding]:
    return {f.component: f for f in findings}


def _assert_no_secret(findings: list[Finding], *secrets: str) -> None:
    text = "\n".join(f.line() for f in findings)
    for secret in secrets:
        assert secret not in text


async def test_a_healthy_setup_is_all_ok_and_changes_nothing(tmp_path: Path) -> None:
    url = pgserver.fresh_url("doc")
    await migrate_store(url)
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            tg = await start_fake(nursery)
            model = await start_fake_openai(nursery, api_key=KEY)
            port = free_port()
            path = _config(
                tmp_path, store=url, web_port=port, tg_origin=tg.origin, model_url=model.base_url
            )
            before = sorted(os.listdir(tmp_path))
            env = {"TG_TOKEN": tg.token, "MODEL_KEY": KEY}
            findings = await diagnose(str(path), env)
            nursery.cancel_scope.cancel()
    lines = [f.line() for f in findings]
    assert all(f.verdict == "ok" for f in findings), lines
    found = _by_component(findings)
    parsed_where = url.split("@", 1)[1].split("?", 1)[0]
    schema = pgserver.schema_of(url)
    assert found[f"PostgreSQL {parsed_where} schema {schema}"].text.startswith("schema at version")
    assert found["Telegram tg-main"].text == "bot @prism_test_bot, polling"
    assert found[f"model server assistant ({model.base_url})"].text == "serves gpt-4o-mini"
    assert found[f"web chat web 127.0.0.1:{port}"].text == "free"
    assert found[f"state directory {tmp_path / 'state'}"].text == "will be created"
    assert found[f"control socket {tmp_path / 'run' / 'control.sock'}"].text == "free"
    assert found[f"config {path}"].verdict == "ok"
    assert lines[-1].startswith("clock: ok")
    assert sorted(os.listdir(tmp_path)) == before  # nothing created
    _assert_no_secret(findings, tg.token, KEY)
    assert [c.method for c in tg.calls] == ["getMe", "getWebhookInfo"]
    assert [r.path for r in model.requests] == ["/v1/models"]


async def test_a_broken_setup_names_each_broken_piece(tmp_path: Path) -> None:
    url = pgserver.fresh_url("doc")
    await migrate_store(url)
    schema = pgserver.schema_of(url)
    # As if this build's migrations after the first were not applied yet.
    await pgserver.query(url, f'DELETE FROM "{schema}".prism_schema_migrations WHERE version > 1')
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            tg = await start_fake(nursery)
            model = await start_fake_openai(nursery, api_key=KEY)
            dead = free_port()  # nothing listens there
            with socket.socket() as held:
                held.bind(("127.0.0.1", 0))
                held.listen()
                port = held.getsockname()[1]
                path = _config(
                    tmp_path,
                    store=url,
                    web_port=port,
                    tg_origin=tg.origin,
                    model_url=model.base_url,
                    state_dir=str(blocker / "state"),
                    socket_path=str(blocker / "run" / "control.sock"),
                    extra=f"""
[agents.keyless]
kind = "openai"
base_url = "{model.base_url}"
model = "gpt-4o-mini"

[agents.local]
kind = "openai"
base_url = "http://127.0.0.1:{dead}/v1"
model = "llama"
""",
                )
                env = {"TG_TOKEN": "654321:wrong-token-abc", "MODEL_KEY": "sk-wrong-key-xyz"}
                findings = await diagnose(str(path), env)
            nursery.cancel_scope.cancel()
    lines = [f.line() for f in findings]
    found = _by_component(findings)
    failed = {f.component for f in findings if f.failed}
    assert failed == {
        f"PostgreSQL {url.split('@', 1)[1].split('?', 1)[0]} schema {schema}",
        "Telegram tg-main",
        f"model server assistant ({model.base_url})",
        f"model server keyless ({model.base_url})",
        f"model server local (http://127.0.0.1:{dead}/v1)",
        f"web chat web 127.0.0.1:{port}",
        f"state directory {blocker / 'state'}",
        f"control socket {blocker / 'run' / 'control.sock'}",
    }, lines
    pg = next(f for f in findings if f.component.startswith("PostgreSQL"))
    pending = ", ".join(str(v) for v in range(2, LATEST + 1))
    assert pg.text == (
        f"schema at version 1 of {LATEST} (pending: {pending}); run prismd migrate --config …"
    )
    assert found["Telegram tg-main"].text.startswith(
        "Telegram refused the token (HTTP 401); check TG_TOKEN"
    )
    assert found[f"model server assistant ({model.base_url})"].text == (
        "the server refused the API key (HTTP 401); check api_key_env MODEL_KEY"
    )
    assert found[f"model server keyless ({model.base_url})"].text == (
        "the server wants an API key (HTTP 401) and none is configured; set api_key_env"
        " (or api_key_file) in [agents.keyless]"
    )
    assert (
        "not reachable (ConnectError)"
        in found[f"model server local (http://127.0.0.1:{dead}/v1)"].text
    )
    assert found[f"web chat web 127.0.0.1:{port}"].text.startswith(
        f"port {port} is in use by another program"
    )
    assert found[f"state directory {blocker / 'state'}"].text.startswith(
        f"{blocker} is not a directory"
    )
    assert found[f"config {path}"].verdict == "ok"  # the file itself is fine
    assert lines[-1].startswith("clock: ok")
    _assert_no_secret(findings, "654321:wrong-token-abc", "sk-wrong-key-xyz")
    # Nothing was migrated: version 2 is still missing.
    rows = await pgserver.query(url, f'SELECT version FROM "{schema}".prism_schema_migrations')
    assert sorted(int(str(r[0])) for r in rows) == [1]


async def test_an_invalid_config_skips_only_what_needs_it(tmp_path: Path) -> None:
    path = tmp_path / "prismd.toml"
    path.write_text("[store\n")
    findings = await diagnose(str(path), {})
    assert [f.component for f in findings] == [f"config {path}", "clock"]
    assert findings[0].failed and findings[0].text.startswith("invalid TOML")
    assert findings[1].verdict == "ok"
    path.write_text(
        '[[connections]]\nid = "web"\nkind = "webchat"\nlisten = "127.0.0.1:0"\n'
        '[agents.a]\nkind = "echo"\n'
        '[[grants]]\nconnection = "web"\nactors = ["*"]\naliases = ["a"]\n'
    )
    assert all(f.verdict == "ok" for f in await diagnose(str(path), {}))
    path.write_text('[agents.a]\nkind = "echo"\n')
    findings = await diagnose(str(path), {})
    assert findings[0].failed and findings[0].text.startswith("[[connections]]: no connection")
    assert not any(f.failed for f in findings[1:])


def test_a_clock_before_the_build_is_named() -> None:
    wrong = _clock(dt.datetime(2001, 9, 9, 1, 46, 40, tzinfo=dt.UTC))
    assert wrong.failed
    assert wrong.text.startswith("the system clock says 2001-09-09 01:46:40 UTC, before this")
    assert "timedatectl" in wrong.text
    assert _clock().verdict == "ok"


@pytest.mark.slow
async def test_the_port_of_the_running_daemon_is_no_failure(tmp_path: Path) -> None:
    """The web chat port held by this config's own running daemon (found through its
    control socket) is fine; the command exits 0 and prints one line per check."""
    layout = write_config(tmp_path, delay_ms=1)
    async with running_daemon(layout) as daemon:
        await daemon.wait_state("READY=1")
        with trio.fail_after(DEADLINE):
            done = await trio.run_process(
                [sys.executable, "-m", "prismd", "doctor", "--config", str(layout.config)],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                env=child_env(),
                cwd=str(tmp_path),
            )
        out = done.stdout.decode()
        assert done.returncode == 0, out + done.stderr.decode()
        lines = out.splitlines()
        web = f"web chat web 127.0.0.1:{layout.port}: ok — in use by the running prismd of this"
        assert any(line.startswith(web) for line in lines), out
        assert any(
            line.startswith(f"control socket {layout.control}: ok — prismd runs") for line in lines
        )
        assert lines[-1] == f"doctor: all {len(lines) - 1} checks ok"
        daemon.send(15)
        assert await daemon.wait_exit() == 0
    # With the daemon gone, a program holding the port is a failure (exit 1).
    with socket.socket() as held:
        held.bind(("127.0.0.1", layout.port))
        held.listen()
        with trio.fail_after(DEADLINE):
            done2 = await trio.run_process(
                [sys.executable, "-m", "prismd", "doctor", "--config", str(layout.config)],
                capture_stdout=True,
                check=False,
                env=child_env(),
                cwd=str(tmp_path),
            )
    assert done2.returncode == 1
    out2 = done2.stdout.decode()
    assert f"web chat web 127.0.0.1:{layout.port}: FAILED — port {layout.port} is in use" in out2
    assert out2.splitlines()[-1].startswith("doctor: 1 problem(s) of ")


async def test_signal_cli_is_reached_on_its_socket(tmp_path: Path) -> None:
    listening = tmp_path / "signal-cli.sock"
    missing = tmp_path / "not-started.sock"
    path = tmp_path / "prismd.toml"
    path.write_text(
        f"""
[daemon]
state_dir = "{tmp_path / "state"}"
[store]
url = "sqlite:///{tmp_path / "journal.sqlite"}"
[control]
socket = "{tmp_path / "run" / "control.sock"}"
[[connections]]
id = "sig"
kind = "signal"
account = "+15550001111"
socket = "{listening}"
[[connections]]
id = "sig2"
kind = "signal"
account = "+15550002222"
socket = "{missing}"
[agents.echo]
kind = "echo"
"""
    )
    server = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await server.bind(str(listening))
    server.listen()
    try:
        with trio.fail_after(DEADLINE):
            found = _by_component(await diagnose(str(path), {}))
    finally:
        server.close()
    assert found["Signal sig"].line() == f"Signal sig: ok — signal-cli answers at {listening}"
    assert found["Signal sig2"].failed
    assert found["Signal sig2"].text.startswith(
        f"signal-cli not reachable at {missing} (nothing listens there); start signal-cli"
    )


async def test_a_silent_server_is_named_within_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that accepts and never answers (Bot API, model server, PostgreSQL): each
    check gives up at its timeout and says so; the whole run stays bounded."""
    monkeypatch.setattr(doctor, "CHECK_TIMEOUT_S", 0.5)
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    silent = f"http://127.0.0.1:{port}"
    path = _config(
        tmp_path,
        store=f"postgresql://prismd@127.0.0.1:{port}/prismd",
        web_port=free_port(),
        tg_origin=silent,
        model_url=f"{silent}/v1",
    )
    try:
        started = trio.current_time()
        with trio.fail_after(DEADLINE):
            found = _by_component(
                await diagnose(str(path), {"TG_TOKEN": "123456:abc-def", "MODEL_KEY": "k"})
            )
        elapsed = trio.current_time() - started
    finally:
        listener.close()
    assert found["Telegram tg-main"].text == f"{silent} did not answer within 0.5 s"
    model = found[f"model server assistant ({silent}/v1)"]
    assert model.text == "no answer within 0.5 s; is the server running?"
    pg = found[f"PostgreSQL 127.0.0.1:{port}/prismd"]
    assert pg.failed and "0.5 s" in pg.text, pg.line()
    assert elapsed < 5, elapsed


async def test_discord_tokens_and_a2a_cards_are_checked_live(tmp_path: Path) -> None:
    """A Discord token answers ``GET /users/@me``; a refused one is named (never shown).
    Each a2a agent's card is fetched (dialect, push, streaming); a silent agent is named,
    and the push receiver's port is checked like every listener."""
    from tests.fakes.a2a_agent import FakeA2A
    from tests.fakes.discord_api import FakeDiscord

    url = pgserver.fresh_url("doc")
    await migrate_store(url)
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            tg = await start_fake(nursery)
            model = await start_fake_openai(nursery, api_key=KEY)
            discord = FakeDiscord(token="discord-bot-token-secret")
            await nursery.start(discord.serve)
            agent = FakeA2A(dialect="0.3", bearer="a2a-bearer-secret")
            await nursery.start(agent.serve)
            push_port, down_port = free_port(), free_port()
            extra = f"""
[[connections]]
id = "dc"
kind = "discord"
token_env = "DC_TOKEN"
api_origin = "{discord.origin}"

[a2a]
push_listen = "127.0.0.1:{push_port}"

[agents.remote]
kind = "a2a"
url = "{agent.base_url}"
bearer_token_env = "A2A_TOKEN"

[agents.gone]
kind = "a2a"
url = "http://127.0.0.1:{down_port}/a2a/"
"""
            path = _config(
                tmp_path,
                store=url,
                web_port=free_port(),
                tg_origin=tg.origin,
                model_url=model.base_url,
                extra=extra,
            )
            env = {
                "TG_TOKEN": tg.token,
                "MODEL_KEY": KEY,
                "DC_TOKEN": "discord-bot-token-secret",
                "A2A_TOKEN": "a2a-bearer-secret",
            }
            good = _by_component(await diagnose(str(path), env))
            refused = await diagnose(str(path), {**env, "DC_TOKEN": "a-wrong-discord-token"})
            nursery.cancel_scope.cancel()
    assert good["Discord dc"].verdict == "ok", good["Discord dc"].line()
    assert good["Discord dc"].text == "bot prism, direct messages"
    remote = good[f"A2A agent remote ({agent.base_url})"]
    assert remote.verdict == "ok", remote.line()
    assert remote.text.startswith("card of ")
    assert remote.text.endswith(": A2A 0.3, push yes, streaming yes")
    gone = good[f"A2A agent gone (http://127.0.0.1:{down_port}/a2a/)"]
    assert gone.failed and "check url" in gone.text
    assert good[f"A2A push receiver 127.0.0.1:{push_port}"].text == "free"
    wrong = _by_component(refused)["Discord dc"]
    assert wrong.failed and "refused the token" in wrong.text
    _assert_no_secret(refused, "a-wrong-discord-token", "a2a-bearer-secret")
    _assert_no_secret(list(good.values()), "discord-bot-token-secret", "a2a-bearer-secret")
