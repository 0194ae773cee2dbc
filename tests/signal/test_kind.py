"""The ``signal`` connection kind in the daemon's config: its keys, their errors, and the
``make run`` defaults that add it when ``SIGNAL_CLI_SOCKET`` is set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from adapters import kinds
from adapters.signal import SignalAdapter, SignalConnectionConfig
from prismd.channel import BuildContext, GrantView
from prismd.daemon._config import (
    ConfigError,
    GrantConfig,
    default_config,
    load_config,
)
from prismd.daemon._runnable import check_runnable
from stores.memory import MemoryStore

BASE = """
[agents.echo]
kind = "echo"

[[connections]]
id = "sig"
kind = "signal"
"""


def load(tmp_path: Path, body: str) -> Any:
    path = tmp_path / "prismd.toml"
    path.write_text(BASE + body)
    return load_config(path, env={})


def error(tmp_path: Path, body: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, body)
    return info.value


def test_keys_and_defaults(tmp_path: Path) -> None:
    config = load(tmp_path, 'account = "+15550001111"\nsocket = "/run/signal-cli/socket"\n')
    assert config.connections == (
        SignalConnectionConfig(id="sig", account="+15550001111", socket="/run/signal-cli/socket"),
    )
    conn = config.connections[0]
    assert (conn.allow_groups, conn.receiver_lease_ttl_ms) == (False, 90_000)
    check_runnable(config, env={})  # the kind is built: nothing to refuse
    config = load(
        tmp_path,
        'account = "+15550001111"\ntcp = "[::1]:7583"\nallow_groups = true\n'
        "receiver_lease_ttl_ms = 6000\n",
    )
    conn = config.connections[0]
    assert (conn.tcp, conn.allow_groups, conn.receiver_lease_ttl_ms) == ("[::1]:7583", True, 6000)


@pytest.mark.parametrize(
    ("body", "key", "fragment"),
    [
        ('account = "15550001111"\nsocket = "/s"', ".account", "international format"),
        ('account = "+1555 0001"\nsocket = "/s"', ".account", "international format"),
        ('account = "+15550001111"\ntcp = "10.0.0.2:7583"', ".tcp", "loopback"),
        ('account = "+15550001111"\ntcp = "signal.example:7583"', ".tcp", "loopback"),
        ('account = "+15550001111"\nsocket = "/' + "x" * 120 + '"', ".socket", "107 bytes"),
        (
            'account = "+15550001111"\nsocket = "/s"\nreceiver_lease_ttl_ms = 1000',
            ".receiver_lease_ttl_ms",
            "between 5000",
        ),
        (
            'account = "+15550001111"\nsocket = "/s"\nallow_groups = "yes"',
            ".allow_groups",
            "true or false",
        ),
    ],
)
def test_bad_keys_are_named(tmp_path: Path, body: str, key: str, fragment: str) -> None:
    exc = error(tmp_path, body)
    assert exc.key is not None and exc.key.endswith(key), str(exc)
    assert fragment in str(exc)
    assert "15550001111" not in exc.message and "0001" not in exc.message


def test_the_builder_makes_an_inert_adapter() -> None:
    kind = kinds.CONNECTION_KINDS["signal"]
    conn = SignalConnectionConfig(
        id="sig", account="+15550001111", tcp="127.0.0.1:7583", allow_groups=True
    )
    assert kind.build is not None and kind.available
    grants: tuple[GrantView, ...] = ()
    adapter = kind.build(
        conn,
        BuildContext(
            admit=_never, store=MemoryStore(), owner_id="owner", secret=_no_secret, grants=grants
        ),
    )
    assert isinstance(adapter, SignalAdapter)
    assert adapter.allow_groups and adapter.lease_ttl_ms == 90_000 and adapter.adopt
    assert kind.where(conn, adapter) == "(signal-cli at tcp:127.0.0.1:7583)"
    assert list(kind.secrets(conn)) == []


async def _never(_event: Any) -> Any:
    raise AssertionError("not admitted at construction")


def _no_secret(*_args: Any) -> str:
    raise AssertionError("signal reads no secret")


def test_make_run_adds_signal_when_the_socket_is_given() -> None:
    config = default_config(
        {"SIGNAL_CLI_SOCKET": "/run/signal-cli/socket", "SIGNAL_ACCOUNT": "+15550001111"}
    )
    assert [c.id for c in config.connections] == ["web", "signal"]
    assert config.connections[1] == SignalConnectionConfig(
        id="signal", account="+15550001111", socket="/run/signal-cli/socket"
    )
    assert config.grants[1] == GrantConfig(connection="signal", pairing=True, aliases=("echo",))
    assert [c.id for c in default_config({"SIGNAL_CLI_SOCKET": " "}).connections] == ["web"]
    both = default_config(
        {"TELEGRAM_BOT_TOKEN": "1:x", "SIGNAL_CLI_SOCKET": "/s", "SIGNAL_ACCOUNT": "+15550001111"}
    )
    assert [c.id for c in both.connections] == ["web", "telegram", "signal"]


@pytest.mark.parametrize("account", [None, "", "15550001111"])
def test_make_run_without_a_usable_account_says_what_to_set(account: str | None) -> None:
    env = {"SIGNAL_CLI_SOCKET": "/run/signal-cli/socket"}
    if account is not None:
        env["SIGNAL_ACCOUNT"] = account
    with pytest.raises(ConfigError, match="SIGNAL_ACCOUNT must be the phone number") as info:
        default_config(env)
    assert info.value.key == "SIGNAL_ACCOUNT"
    assert "15550001111" not in str(info.value)
