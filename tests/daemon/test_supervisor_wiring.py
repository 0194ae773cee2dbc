"""Wiring: agents per alias, adapters per connection, host callbacks, startup refusals."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from adapters import kinds
from adapters.webchat._adapter import WebchatAdapter
from prismd.channel import (
    NO_FEATURES,
    AdapterFeatures,
    AdapterRegistry,
    AttachmentRef,
    InboundEvent,
    Preview,
    Reply,
    SendResult,
)
from prismd.daemon._config import ConfigError, parse_config
from prismd.daemon._daemon import Daemon
from prismd.daemon._statedir import locked_state_dir
from prismd.daemon._wiring import WiringError, adapter_child_name, build_adapter, build_agents
from prismd.grants import AuthorizeInput, Grant, ownership_from_identity
from prismd.runtime import Runtime, open_messaging_runtime
from stores import open_store
from tests.support.builders import IDENTITY

BASE = {
    "connections": [{"id": "web", "kind": "webchat", "listen": "127.0.0.1:0"}],
    "agents": {"echo": {"kind": "echo"}, "slow": {"kind": "mock", "delay_ms": 5}},
    "grants": [{"connection": "web", "actors": ["*"], "aliases": ["echo", "slow"]}],
}


def _reply(connection: str) -> Reply:
    return Reply(connection_id=connection, external_conversation_id="c", text="t", kind="final")


class FakeAdapter:
    connection_id = "web"
    features = NO_FEATURES
    receiver_lease_held = False

    def __init__(self) -> None:
        self.sent: list[Reply] = []
        self.asked: list[str] = []

    async def send(self, reply: Reply) -> SendResult:
        self.sent.append(reply)
        return SendResult(delivered=True, message_id="1")

    # What an adapter without optional features offers: the host must not call them.
    def send_draft(self, preview: Preview) -> None:
        self.asked.append("send_draft")

    async def send_typing(
        self, external_conversation_id: str, thread_id: str | None = None
    ) -> None:
        self.asked.append("send_typing")

    async def fetch_attachment(self, ref: AttachmentRef) -> object:
        self.asked.append("fetch_attachment")
        return b"not mine"

    async def aclose(self) -> None:
        self.asked.append("aclose")


async def test_agents_are_built_per_alias_with_the_store() -> None:
    async with open_store("memory://") as store:
        config = parse_config(BASE)
        agents = build_agents(config, store)
        assert set(agents) == {"echo", "slow"}
        # The runtime is opened with them and resolves a route's alias to its agent.
        async with open_messaging_runtime(
            authorize=_no_grant, agents=agents, adapters=AdapterRegistry()
        ) as runtime:
            core = runtime._core

            def route(alias: str) -> Any:
                scope = ownership_from_identity(IDENTITY)
                parts = (scope.tenant_id, scope.account_id, scope.user_id)
                return core.routes.route(("web", "chat-1", None, "actor", alias, *parts))

            assert await core.resolve_agent(route("slow"), IDENTITY) is agents["slow"]
            with pytest.raises(LookupError):
                await core.resolve_agent(route("missing"), IDENTITY)


async def _no_grant(_request: AuthorizeInput) -> Grant | None:
    return None


async def test_deliver_routes_by_connection_and_unknown_is_not_delivered() -> None:
    fake = FakeAdapter()
    adapters = AdapterRegistry([fake])  # type: ignore[list-item]
    assert await adapters.send(_reply("web")) == SendResult(delivered=True, message_id="1")
    assert fake.sent == [_reply("web")]
    assert await adapters.send(_reply("tg")) == SendResult(
        delivered=False, reason="unknown_connection"
    )


async def test_admit_before_the_runtime_is_opened_is_retryable() -> None:
    runtime = Runtime()  # what the adapters are built with, opened later
    event = InboundEvent(
        connection_id="web", external_conversation_id="c", external_actor_id="a", event_id="1"
    )
    first = await runtime.admit(event)
    assert first.status == "denied" and first.reason == "unavailable" and first.retryable
    assert (
        await runtime.recent_replies(
            connection_id="web", external_conversation_id="c", external_actor_id="a"
        )
        == []
    )
    assert runtime.busy_conversations("web") == frozenset()
    seen: list[str] = []

    async def authorize(request: AuthorizeInput) -> Grant | None:
        seen.append(request.event_id)
        return None

    async with open_messaging_runtime(
        authorize=authorize, agents={}, adapters=AdapterRegistry(), runtime=runtime
    ):
        await runtime.admit(event)
    assert seen == [event.event_id]


async def test_build_adapter_for_webchat_and_missing_secrets(tmp_path: Path) -> None:
    async with open_store("memory://") as store:
        with locked_state_dir(tmp_path) as state:
            config = parse_config(BASE)
            (web,) = config.connections
            adapter = build_adapter(
                web, runtime=Runtime(), store=store, state=state, config=config, env={}
            )
            assert isinstance(adapter, WebchatAdapter)
            assert adapter.connection_id == "web"
            assert adapter_child_name(web) == "webchat:web"

            guarded = parse_config(
                {
                    **BASE,
                    "connections": [
                        {"id": "web", "kind": "webchat", "access_token_env": "WEB_TOKEN"}
                    ],
                }
            )
            with pytest.raises(ConfigError, match="WEB_TOKEN"):
                build_adapter(
                    guarded.connections[0],
                    runtime=Runtime(),
                    store=store,
                    state=state,
                    config=guarded,
                    env={},
                )
            telegram = parse_config(
                {
                    **BASE,
                    "connections": [
                        *BASE["connections"],
                        {"id": "tg", "kind": "telegram", "token_env": "TG_TOKEN"},
                    ],
                }
            )
            with pytest.raises(ConfigError, match="TG_TOKEN") as info:
                build_adapter(
                    telegram.connections[1],
                    runtime=Runtime(),
                    store=store,
                    state=state,
                    config=telegram,
                    env={},
                )
            assert "123:" not in str(info.value)


async def test_second_daemon_on_the_same_state_dir_is_refused(tmp_path: Path) -> None:
    config = parse_config(
        {
            **BASE,
            "daemon": {"state_dir": str(tmp_path / "state")},
            "store": {"url": "sqlite:///" + str(tmp_path / "j.sqlite")},
        }
    )
    out = io.StringIO()
    with locked_state_dir(tmp_path / "state"):
        daemon = Daemon(config, env={}, install_signals=False, out=out)
        with trio.fail_after(10):
            assert await daemon.run() == 1
    assert "another prismd is already running" in out.getvalue()
    assert daemon.stopped.is_set()


def test_wiring_error_names_the_part() -> None:
    assert "signal" in str(WiringError("connection kind 'signal' is not available in this build"))


async def test_unavailable_connection_kind_is_a_clear_startup_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A kind without a builder is one this build does not have (adapters.kinds).
    unbuilt = attrs.evolve(kinds.CONNECTION_KINDS["signal"], build=None)
    monkeypatch.setattr(kinds, "CONNECTION_KINDS", {**kinds.CONNECTION_KINDS, "signal": unbuilt})
    config = parse_config(
        {
            **BASE,
            "daemon": {"state_dir": str(tmp_path / "state")},
            "store": {"url": "sqlite:///" + str(tmp_path / "j.sqlite")},
            "connections": [
                *BASE["connections"],
                {"id": "sig", "kind": "signal", "account": "+15550001111", "tcp": "127.0.0.1:7583"},
            ],
        }
    )
    out = io.StringIO()
    daemon = Daemon(config, env={}, install_signals=False, notify=lambda _s: None, out=out)
    with trio.fail_after(20):
        assert await daemon.run() == 1
    assert "connection kind 'signal' is not available in this build" in out.getvalue()
    assert not daemon.ready.is_set()


async def test_previews_and_attachments_route_to_adapters_that_support_them() -> None:
    class Drafting(FakeAdapter):
        features = AdapterFeatures(previews=True, typing=True, attachments=True)

        def __init__(self) -> None:
            super().__init__()
            self.drafts: list[Preview] = []
            self.typing: list[tuple[str, str | None]] = []

        def send_draft(self, preview: Preview) -> None:
            self.drafts.append(preview)
            if preview.text == "boom":
                raise RuntimeError("draft failed")

        async def fetch_attachment(self, ref: AttachmentRef) -> object:
            return b"bytes" if ref.transport_file_id == "mine" else None

        async def send_typing(
            self, external_conversation_id: str, thread_id: str | None = None
        ) -> None:
            self.typing.append((external_conversation_id, thread_id))

    adapters = AdapterRegistry()
    assert not any(adapters.any_offers(f) for f in ("previews", "attachments", "typing"))
    drafting = Drafting()
    drafting.connection_id = "tg"
    adapters.add(drafting)  # type: ignore[arg-type]
    adapters.add(FakeAdapter())  # type: ignore[arg-type]
    assert adapters.any_offers("previews") and adapters.any_offers("attachments")
    preview = Preview(connection_id="tg", external_conversation_id="101", text="partial")
    adapters.send_draft(preview)
    adapters.send_draft(Preview(connection_id="tg", external_conversation_id="101", text="boom"))
    adapters.send_draft(Preview(connection_id="web", external_conversation_id="c", text="x"))
    adapters.send_draft(Preview(connection_id="nope", external_conversation_id="c", text="x"))
    assert [p.text for p in drafting.drafts] == ["partial", "boom"]
    assert await adapters.fetch_attachment(AttachmentRef("image", "mine")) == b"bytes"
    assert await adapters.fetch_attachment(AttachmentRef("image", "other")) is None
    # A ref names its connection: only that adapter is asked, and only if it fetches files.
    mine = AttachmentRef("image", "mine", connection_id="tg")
    assert await adapters.fetch_attachment(mine) == b"bytes"
    for elsewhere in ("web", "x"):
        ref = AttachmentRef("image", "mine", connection_id=elsewhere)
        assert await adapters.fetch_attachment(ref) is None
    assert adapters.any_offers("typing")
    await adapters.send_typing("tg", "101", "7")
    await adapters.send_typing("web", "c", None)
    await adapters.send_typing("nope", "c", None)
    assert drafting.typing == [("101", "7")]
    # The adapter without features was never asked for one (declared, not probed).
    assert adapters["web"].asked == []  # type: ignore[attr-defined]
    await adapters.aclose()
    assert drafting.asked == ["aclose"]


async def test_exposed_webchat_with_only_pairing_grants_is_pairing_only(tmp_path: Path) -> None:
    """A web chat off loopback without a token is allowed by config only when its grants
    need pairing; wiring must tell the adapter so, or it refuses to start."""
    async with open_store("memory://") as store:
        with locked_state_dir(tmp_path) as state:
            config = parse_config(
                {
                    "connections": [{"id": "web", "kind": "webchat", "listen": "192.0.2.1:8787"}],
                    "agents": {"echo": {"kind": "echo"}},
                    "grants": [{"connection": "web", "pairing": True, "aliases": ["echo"]}],
                }
            )
            (web,) = config.connections
            adapter = build_adapter(
                web, runtime=Runtime(), store=store, state=state, config=config, env={}
            )
            assert isinstance(adapter, WebchatAdapter) and adapter.pairing_only is True
            loopback = parse_config(BASE)
            plain = build_adapter(
                loopback.connections[0],
                runtime=Runtime(),
                store=store,
                state=state,
                config=loopback,
                env={},
            )
            assert isinstance(plain, WebchatAdapter) and plain.pairing_only is False


def test_startup_hint_for_an_unbound_ipv6_web_chat() -> None:
    """Before the listener is bound the hint comes from config: `[::1]:8787` must read
    `http://[::1]:8787/`, not `http://[[::1]]:8787/`."""
    from prismd.daemon._config import WebchatConnectionConfig
    from prismd.daemon._serving import _where

    class Unbound:
        bound = None

    web = WebchatConnectionConfig(id="web", listen="[::1]:8787")
    assert _where(web, Unbound()) == "http://[::1]:8787/"  # type: ignore[arg-type]
    v4 = WebchatConnectionConfig(id="web", listen="127.0.0.1:8787")
    assert _where(v4, Unbound()) == "http://127.0.0.1:8787/"  # type: ignore[arg-type]
