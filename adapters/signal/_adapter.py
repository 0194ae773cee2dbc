"""The Signal channel adapter (experimental): configuration, and the parts that do the work.

Contract §12, over a ``signal-cli -a ACCOUNT daemon --receive-mode=manual`` on a Unix socket
or loopback TCP. :class:`SignalAdapter` validates its configuration and wires parts of one
job each:

* the transport — :class:`~adapters.signal._client.Endpoint` and the toolkit's JSON-RPC
  client (:mod:`._client`);
* receiving — :class:`~adapters.signal._receive.Receiver`: the receiver lease, the
  readiness probe (:mod:`._readiness`), one manual subscription, pausing and reconnecting,
  the durable inbox (:mod:`._inbox`) every received message is written to first;
* notification → event — :mod:`._filter` (only our subscription's, only our account's) and
  :mod:`._parse` (which messages count, and the policy for groups and attachments);
* sending — :class:`~adapters.signal._send.SignalSender` (chunks, approval lines, results
  by JSON-RPC error code and per-recipient result type); the typing indicator
  (``sendTyping``, which the runtime starts once a turn has run ``typing_delay_ms``);
* health and counters — :mod:`._status`.

Construction is inert: nothing is connected, read or written until ``run`` or ``send``.
"""

from __future__ import annotations

import random as _random
import re
from collections.abc import Mapping

import attrs
import trio

from prismd.channel import (
    DEFAULT_TYPING_DELAY_MS,
    MAX_TYPING_DELAY_MS,
    AdapterFatalError,
    AdapterFeatures,
    Admit,
    Reply,
    SendResult,
)
from stores import SYSTEM_CLOCK, Clock, OwnershipScope, Store

from ..toolkit import (
    Activity,
    AdapterDefaults,
    JsonRpcClient,
    JsonRpcConnectionError,
    JsonRpcTimeoutError,
    LeaseWatch,
    ReceiverLease,
    RpcError,
    bounded_field,
    check_connection_id,
    connection_service_scope,
)
from ._client import Endpoint, SignalUnreachableError, open_request_client
from ._filter import NotificationFilter
from ._inbox import Inbox
from ._readiness import RECEIVER_NAMESPACE
from ._receive import Receiver
from ._send import MAX_CHUNK_UNITS, SignalSender, _destination
from ._status import SignalStatistics, SignalStatus, log

__all__ = ["ACCOUNT_RE", "SignalAdapter"]

ACCOUNT_RE = re.compile(r"^\+[0-9]{1,20}$")
"""The account as signal-cli's ``-a`` takes it: the phone number in international format."""


@attrs.define(eq=False, kw_only=True)
class SignalAdapter(AdapterDefaults):
    """The Signal channel adapter (implements :class:`prismd.channel.ChannelAdapter`).

    ``run`` receives until cancelled (and raises :class:`~prismd.channel.AdapterFatalError`
    when signal-cli serves another account); ``send`` works whether or not ``run`` runs.
    No previews, attachments or files yet (:class:`~adapters.toolkit.AdapterDefaults`).
    """

    connection_id: str = attrs.field(validator=check_connection_id)
    account: str = attrs.field(repr=False)
    admit: Admit
    store: Store
    owner_id: str = attrs.field(repr=False)
    socket: str | None = None
    tcp: str | None = None
    allow_groups: bool = False
    service_scope: OwnershipScope = attrs.field(default=None)
    adopt: bool = True
    lease_ttl_ms: int = bounded_field(90_000, 5_000, 300_000)
    request_timeout_s: float = bounded_field(10.0, 0.1, 60.0)
    send_timeout_s: float = bounded_field(60.0, 0.1, 300.0)
    max_frame_bytes: int = bounded_field(128 * 1024, 1024, 512 * 1024)
    max_pending_requests: int = bounded_field(16, 1, 64)
    max_pending_events: int = bounded_field(32, 1, 128)
    reconnect_delay_s: float = bounded_field(1.0, 0.001, 60.0)
    max_reconnect_delay_s: float = bounded_field(30.0, 0.001, 60.0)
    typing_delay_ms: int = bounded_field(DEFAULT_TYPING_DELAY_MS, 0, MAX_TYPING_DELAY_MS)
    """How long a turn runs before its typing indicator starts (declared in
    :attr:`features`; the runtime keeps the time, the same rule as Telegram's)."""
    clock: Clock = SYSTEM_CLOCK
    random: _random.Random | None = None

    endpoint: Endpoint = attrs.field(init=False)
    _status: SignalStatus = attrs.field(init=False)
    _activity: Activity = attrs.field(factory=Activity, init=False)
    """When a message last reached the adapter (``lastUpdateAt`` in ``health``)."""
    _lease: ReceiverLease = attrs.field(init=False, repr=False)
    _lease_watch: LeaseWatch = attrs.field(factory=LeaseWatch, init=False, repr=False)
    _receiver: Receiver = attrs.field(init=False)
    _sender: SignalSender = attrs.field(init=False)

    @account.validator
    def _check_account(self, _a: object, value: str) -> None:
        if not isinstance(value, str) or not ACCOUNT_RE.fullmatch(value):
            raise ValueError("account must be a phone number in international format (+…)")

    def __attrs_post_init__(self) -> None:
        if self.service_scope is None:
            self.service_scope = connection_service_scope(self.connection_id)
        if self.max_reconnect_delay_s < self.reconnect_delay_s:
            raise ValueError("max_reconnect_delay_s must be at least reconnect_delay_s")
        self.endpoint = Endpoint(socket=self.socket, tcp=self.tcp)
        rng = self.random if self.random is not None else _random.Random()
        self._status = SignalStatus(self.connection_id)
        self._lease = ReceiverLease.for_adapter(
            self,
            kind="signal",
            namespace=RECEIVER_NAMESPACE,
            log=log,
            random=rng,
            watch=self._lease_watch,
        )
        self._receiver = Receiver(
            connection_id=self.connection_id,
            endpoint=self.endpoint,
            admit=self._activity.seeing(self.admit),
            lease=self._lease,
            checkpoints=self.store.checkpoints,
            service_scope=self.service_scope,
            inbox=Inbox(
                connection_id=self.connection_id,
                store=self.store.inbox,
                checkpoints=self.store.checkpoints,
                scope=self.service_scope,
            ),
            status=self._status,
            filter=NotificationFilter(
                connection_id=self.connection_id,
                account=self.account,
                allow_groups=self.allow_groups,
                status=self._status,
                clock=self.clock,
            ),
            clock=self.clock,
            random=rng,
            timeout_s=float(self.request_timeout_s),
            max_frame_bytes=self.max_frame_bytes,
            max_pending_requests=self.max_pending_requests,
            max_pending_events=self.max_pending_events,
            reconnect_delay_s=float(self.reconnect_delay_s),
            max_reconnect_delay_s=float(self.max_reconnect_delay_s),
        )
        self._sender = SignalSender(
            connection_id=self.connection_id,
            endpoint=self.endpoint,
            status=self._status,
            timeout_s=float(self.send_timeout_s),
            max_frame_bytes=self.max_frame_bytes,
        )

    # ------------------------------------------------------------------ public surface

    def health(self) -> Mapping[str, str]:
        """``state`` (:data:`~adapters.signal._status.STATES`), ``bridge`` (unavailable |
        connected), ``subscription`` (inactive | active | paused), ``account`` (unverified |
        ready | mismatch | identity_changed); ``lastUpdateAt`` once a message reached it."""
        return {**self._status.health(), **self._activity.health_fields()}

    def statistics(self) -> SignalStatistics:
        """What became of the notifications so far (counters only)."""
        return self._status.statistics()

    @property
    def capabilities(self) -> Mapping[str, object]:
        """Contract §3 ``ChannelCapabilities``: no transport acknowledgement, text commands."""
        return {
            "acknowledgement": "none",
            "controls": "command",
            "max_text_code_units": MAX_CHUNK_UNITS,
        }

    @property
    def features(self) -> AdapterFeatures:
        return AdapterFeatures(typing=True, typing_delay_ms=self.typing_delay_ms)

    @property
    def receiver_lease_held(self) -> bool:
        return self._lease.held

    async def wait_receiver_lease(self, held: bool) -> None:
        await self._lease_watch.wait(lambda: self._lease.held, held)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Receive until cancelled (see :mod:`adapters.signal._receive`); started once
        receiving or standing by for the lease."""
        if await self._receiver.run(task_status):
            raise AdapterFatalError("signal-cli serves another account than the configured one")

    async def send(self, reply: Reply) -> SendResult:
        """See :meth:`adapters.signal._send.SignalSender.send`."""
        return await self._sender.send(reply)

    async def send_typing(
        self, external_conversation_id: str, thread_id: str | None = None
    ) -> None:
        """signal-cli's ``sendTyping`` to the conversation, on a short connection of its own
        (as a send: it never shares fate with the receiving one). Failures are ignored:
        an indicator is a courtesy, logged at DEBUG by class only."""
        target = _destination(external_conversation_id)
        if target is None:
            return
        failure: str | None = None

        async def typing(client: JsonRpcClient) -> None:
            nonlocal failure
            try:
                await client.call("sendTyping", target)
            except (RpcError, JsonRpcTimeoutError, JsonRpcConnectionError) as exc:
                failure = type(exc).__name__

        try:
            async with open_request_client(
                self.endpoint,
                timeout_s=self.request_timeout_s,
                max_frame_bytes=self.max_frame_bytes,
            ) as client:
                await typing(client)
        except SignalUnreachableError:
            failure = "SignalUnreachableError"
        if failure is not None:
            log.debug("signal %s: typing indicator failed (%s)", self.connection_id, failure)
