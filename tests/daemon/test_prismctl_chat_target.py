"""``prismctl chat`` talks to the web chat of the daemon it is pointed at: ``--url``, else
the first ``webchat`` connection of ``--config FILE``, else of ``./prismd.toml`` (what
``prismd run`` reads there), else ``make run``'s 127.0.0.1:8787. It always went to 8787:
a daemon whose config moved the web chat was "connection refused", or another daemon
still on 8787 answered instead."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from prismd.cli._ctlsocket import chat_target
from tests.webchat._stack import chat_stack

from .test_prismctl import DEADLINE, prismctl

pytestmark = pytest.mark.slow  # real subprocesses


def _webchat(port: int, extra: str = "") -> str:
    return f'[[connections]]\nid = "moved"\nkind = "webchat"\nlisten = "127.0.0.1:{port}"\n{extra}'


async def test_chat_finds_the_web_chat_of_the_config(tmp_path: Path) -> None:
    env = {"XDG_STATE_HOME": str(tmp_path / "state"), "PRISMD_CONTROL_SOCKET": ""}
    with trio.fail_after(DEADLINE):
        async with chat_stack() as (adapter, _):
            assert adapter.bound is not None
            port = adapter.bound[1]
            connected = f"connected to ws://127.0.0.1:{port}/ws as "
            # ./prismd.toml where prismctl runs, as `prismd run` reads it there.
            (tmp_path / "prismd.toml").write_text(_webchat(port))
            code, _, err = await prismctl("chat", env=env, cwd=tmp_path)
            assert code == 0 and err.startswith(connected), err
            # --config FILE from anywhere, before or after the command.
            elsewhere = tmp_path / "elsewhere"
            elsewhere.mkdir()
            config = str(tmp_path / "prismd.toml")
            for args in (("--config", config, "chat"), ("chat", "--config", config)):
                code, _, err = await prismctl(*args, env=env, cwd=elsewhere)
                assert code == 0 and err.startswith(connected), err


async def test_a_config_without_a_web_chat_or_its_token_is_named(tmp_path: Path) -> None:
    path = tmp_path / "prismd.toml"
    path.write_text('[[connections]]\nid = "tg"\nkind = "telegram"\n')
    with trio.fail_after(DEADLINE):
        code, _, err = await prismctl("chat", "--config", str(path))
        assert (code, err) == (
            1,
            f"prismctl: {path} has no webchat connection with a listen address; name the web"
            " chat with --url URL\n",
        )
        path.write_text(_webchat(9, 'access_token_env = "PRISMD_TEST_UNSET_WEB_TOKEN"\n'))
        code, _, err = await prismctl("chat", "--config", str(path))
        assert (code, err) == (
            1,
            f"prismctl: the web chat 'moved' in {path} needs its access token: set"
            " PRISMD_TEST_UNSET_WEB_TOKEN\n",
        )
        missing = tmp_path / "nope.toml"
        code, _, err = await prismctl("chat", "--config", str(missing))
        assert (code, err) == (1, f"prismctl: --config {missing}: file not found\n")


def test_the_address_comes_from_listen_or_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert chat_target(None, None).url == "http://127.0.0.1:8787/"  # no ./prismd.toml
    assert chat_target("http://h:1/", None).url == "http://h:1/"
    path = tmp_path / "prismd.toml"
    for listen, url in (
        ("0.0.0.0:9001", "http://127.0.0.1:9001/"),
        ("[::]:9002", "http://[::1]:9002/"),
        ("[::1]:9003", "http://[::1]:9003/"),
        ("192.0.2.7:9004", "http://192.0.2.7:9004/"),
    ):
        path.write_text(
            f'[[connections]]\nid = "w"\nkind = "webchat"\nlisten = "{listen}"\n'
            'access_token_env = "WEB_TOKEN"\n'
        )
        target = chat_target(None, None)
        assert (target.url, target.token_env) == (url, "WEB_TOKEN")
        assert target.source == "the web chat 'w' in prismd.toml"
    assert os.path.isfile("prismd.toml")
