"""The Discord gateway protocol without I/O (reference/discord-protocol.md §1, §2, §5).

Frames in and out, the close-code table, the heartbeat rule and the identify budget: what
the connection loop (:mod:`._gateway`) decides, as functions and small state objects it
drives with its own clock, so each rule is tested without a socket.
"""

from __future__ import annotations

import json
import math
import random as _random
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

GATEWAY_VERSION = 10
MAX_PAYLOAD_BYTES = 4096
"""A client payload over this closes the connection with 4002."""

# Opcodes (OPS "Gateway Opcodes").
DISPATCH = 0
HEARTBEAT = 1
IDENTIFY = 2
RESUME = 6
RECONNECT = 7
INVALID_SESSION = 9
HELLO = 10
HEARTBEAT_ACK = 11

# Intents (GW "List of Intents").
GUILDS = 1 << 0
GUILD_MESSAGES = 1 << 9
DIRECT_MESSAGES = 1 << 12
MESSAGE_CONTENT = 1 << 15
INTENT_NAMES: Mapping[str, int] = {
    "guilds": GUILDS,
    "guild_messages": GUILD_MESSAGES,
    "direct_messages": DIRECT_MESSAGES,
    "message_content": MESSAGE_CONTENT,
}

RESUMABLE_CLOSE = 4000
"""What we close with, on every path: never 1000/1001, which end the session (GW
"Initiating a Disconnect"); 4000 is what discord.py uses."""

FATAL_CLOSE_CODES: Mapping[int, str] = {
    4004: "authentication failed (the bot token is wrong or was reset)",
    4010: "invalid shard",
    4011: 'sharding required (set shards = "auto" or a larger count)',
    4012: "invalid API version",
    4013: "invalid intents",
    4014: "disallowed intents (enable the privileged intent in the developer portal, "
    'or use respond_to = "mentions")',
}
"""Close codes whose "Reconnect" column is false: the connection stops with this text."""

NEW_SESSION_CLOSE_CODES = frozenset({4007})
"""Reconnectable, but the session cannot be resumed: our ``seq`` was refused."""

SESSION_REFUSAL_CODES = frozenset({4003, 4005, 4006, 4008, 4009})
"""Closes that may mean the session is gone (not authenticated, timed out …): resumed
first — "the session will remain active" after any close but 1000/1001, and its replay
holds what nothing else can recover — but a Resume answered by one of these
:data:`MAX_REFUSED_RESUMES` times in a row gives the session up (:mod:`._gateway`)."""


CloseAction = Literal["fatal", "identify", "resume"]


def close_action(code: int | None) -> CloseAction:
    """What a close means: ``fatal`` (stop), ``identify`` (a new session) or ``resume``.

    A close without a code (TCP dropped), 1000/1001 from Discord (an "improper" close, as
    discord.py counts it), 4000-4003, 4005, 4006, 4008, 4009 and codes not in the table
    resume, as discord.py does after any reconnectable close: if the session is in fact
    gone, the Resume is answered with op 9 (or refused again: see
    :data:`SESSION_REFUSAL_CODES`) and we identify then. Identifying at once would lose
    what the session still holds for channels no backfill knows (a new user's DM).
    """
    if code in FATAL_CLOSE_CODES:
        return "fatal"
    if code in NEW_SESSION_CLOSE_CODES:
        return "identify"
    return "resume"


MAX_REFUSED_RESUMES = 2
GAP_RESUMES_PER_MINUTE = 30
"""Gaps in the dispatch sequence resumed for in any 60 s, at most (:class:`Gaps`)."""
UNFILLED_GAPS = 2
"""After this many gaps a replay did not fill, a session's gaps are taken as its numbering."""


@attrs.define(eq=False)
class RefusedResumes:
    """Resumes the gateway turned down in a row before RESUMED (a close of
    :data:`SESSION_REFUSAL_CODES`, op 9 ``true``): at :data:`MAX_REFUSED_RESUMES` the
    session is given up and a new one identified. A gateway may answer an expired
    session's Resume by closing (4009 "start a new one", 4003 …) rather than with op 9
    ``false``: without this a shard would resume the dead session forever."""

    resuming: bool = False
    """A Resume was sent on this connection and RESUMED has not come yet."""
    count: int = 0

    def resumed(self) -> None:
        """READY or RESUMED: the session (a new one, or the resumed one) is live."""
        self.resuming = False
        self.count = 0

    def give_up(self, action: CloseAction, refused: bool) -> bool:
        """A connection ended (its ``action``; ``refused``: the gateway turned the session
        down): whether to give the session up now."""
        resuming, self.resuming = self.resuming, False
        if not (resuming and action == "resume" and refused):
            return False
        self.count += 1
        if self.count < MAX_REFUSED_RESUMES:
            return False
        self.count = 0
        return True


@attrs.define(eq=False)
class Gaps:
    """Gaps in a session's dispatch sequence (``s`` jumped past ``missing``: dispatches
    sent and lost on the way), each resumed for — a resume from the watermark replays
    them — but a gap the replay did not fill (the same ``missing`` again: ``s`` need only
    increase) is passed over; after :data:`UNFILLED_GAPS` of those the session's gaps are
    its numbering, all passed over; and so is any past :data:`GAP_RESUMES_PER_MINUTE` (no
    storm of resumes)."""

    resumes: list[float] = attrs.field(factory=list)
    """When the gaps of the last minute were resumed for (Trio time)."""
    tried: set[int] = attrs.field(factory=set)
    """The first missing ``s`` of each gap of this session resumed for already."""
    unfilled: set[int] = attrs.field(factory=set)
    """The gaps of this session (first missing ``s``) a replay did not fill."""

    def new_session(self) -> None:
        """READY: a new session numbers from 1 again."""
        self.tried.clear()
        self.unfilled.clear()

    def resume_for(self, missing: int, now: float) -> bool:
        """Whether to resume for the gap before ``missing`` + 1 (counted as done)."""
        if missing in self.tried:
            self.unfilled.add(missing)
            return False
        self.resumes = [t for t in self.resumes if now - t < 60.0]
        if len(self.unfilled) >= UNFILLED_GAPS or len(self.resumes) >= GAP_RESUMES_PER_MINUTE:
            return False
        if len(self.tried) >= 64:
            self.tried.clear()
        self.tried.add(missing)
        self.resumes.append(now)
        return True


@attrs.frozen
class Frame:
    op: int
    d: Any
    s: int | None = None
    t: str | None = None


class ProtocolError(Exception):
    """A frame that is not a gateway payload (fixed text, never the frame)."""


HANDLED_DISPATCHES = frozenset({"READY", "RESUMED", "MESSAGE_CREATE"})
"""The dispatches whose ``d`` the connection reads; any other only moves the sequence."""

_HEAD = re.compile(r'\{(?:"(?:op|s|t)":(?:null|\d{1,19}|"[A-Z0-9_]{1,64}"),){3}"d":')
"""``op``, ``s`` and ``t`` ahead of ``d``, as Discord writes its frames: scalars only, so
this prefix is the frame's top level, never a value inside ``d``."""
_HEAD_T = re.compile(r'"t":"([A-Z0-9_]+)"')


def parse_frame(raw: str | bytes) -> Frame:
    """One gateway frame. A dispatch outside :data:`HANDLED_DISPATCHES` (``GUILD_CREATE``,
    ``TYPING_START``, ``MESSAGE_UPDATE`` …) whose ``op``, ``s`` and ``t`` come before its
    ``d`` is read from that prefix alone: its ``d`` (``None`` here) is never decoded."""
    if isinstance(raw, str):
        head = _HEAD.match(raw)
        if head is not None:
            name = _HEAD_T.search(raw, 0, head.end())
            if name is not None and name.group(1) not in HANDLED_DISPATCHES:
                return _frame(_loads(raw[: head.end() - 5] + "}"), skip_d=True)
    return _frame(_loads(raw), skip_d=False)


def _loads(raw: str | bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        raise ProtocolError("gateway frame is not JSON") from None


def _frame(payload: Any, *, skip_d: bool) -> Frame:
    if not isinstance(payload, Mapping) or not isinstance(payload.get("op"), int):
        raise ProtocolError("gateway frame has no opcode")
    s = payload.get("s")
    t = payload.get("t")
    return Frame(
        payload["op"],
        None if skip_d else payload.get("d"),
        s if isinstance(s, int) and not isinstance(s, bool) else None,
        t if isinstance(t, str) else None,
    )


def json_number(value: object) -> float | None:
    """A JSON number (``45000`` or ``45000.0``: JSON does not tell them apart), finite;
    ``None`` for anything else (a bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def encode(op: int, d: Any) -> str:
    text = json.dumps({"op": op, "d": d}, separators=(",", ":"))
    if len(text.encode()) > MAX_PAYLOAD_BYTES:
        raise ProtocolError("gateway payload over 4096 bytes")
    return text


def identify(token: str, intents: int, shard: tuple[int, int]) -> str:
    return encode(
        IDENTIFY,
        {
            "token": token,
            "properties": {"os": "linux", "browser": "prismd", "device": "prismd"},
            "compress": False,
            "intents": intents,
            "shard": list(shard),
        },
    )


def resume(token: str, session_id: str, seq: int) -> str:
    return encode(RESUME, {"token": token, "session_id": session_id, "seq": seq})


def heartbeat(seq: int | None) -> str:
    return encode(HEARTBEAT, seq)


def gateway_url(base: str) -> str:
    """``base`` with the version and encoding query (GW "Gateway URL Query String Params"):
    its path as given (``/`` if none), its own query parameters kept, ``v`` and
    ``encoding`` ours."""
    parts = urllib.parse.urlsplit(base)
    query = [
        (k, v)
        for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        if k not in ("v", "encoding")
    ]
    query += [("v", str(GATEWAY_VERSION)), ("encoding", "json")]
    path = parts.path or "/"
    return urllib.parse.urlunsplit(
        (parts.scheme, parts.netloc, path, urllib.parse.urlencode(query), "")
    )


ZOMBIE_GRACE_SHARE = 0.25
ZOMBIE_GRACE_MAX_S = 2.0
"""How long after a beat is due an unacknowledged one makes a zombie: a quarter of the
interval, at most two seconds (Discord's interval is about 41 s)."""
BACKLOG_INTERVALS = 3
"""While frames are still being read, or after a stall of the process, an unacknowledged
beat waits for its ACK up to this many intervals after it was sent (and a grace), no
longer."""


@attrs.define(eq=False)
class Heartbeater:
    """The heartbeat rule (GW "Heartbeat Interval"): the first beat after ``interval ×
    jitter``, then one per interval; a beat due while the previous one is unacknowledged
    means the connection is a zombie (close it, resume) — judged only when nothing says the
    ACK may still be on its way:

    * :attr:`grace_s` after the beat was due: a frame already received is read in that time;
    * while the reader still reads frames (one within the grace: a backlog, the ACK behind
      it in the stream);
    * after a stall of this process (its timer woke late: the reader has not read what came
      meanwhile), a grace from the end of the stall;

    the last two up to :data:`BACKLOG_INTERVALS` after the beat (and its grace): whatever
    happens, a beat never acknowledged is judged by then. A silent connection is a zombie
    after the grace, as before."""

    interval_s: float
    random: _random.Random
    acked: bool = True
    next_at: float = 0.0
    sent_at: float = 0.0
    heard_at: float = -math.inf
    """When the reader last read a frame."""
    stalled_until: float = -math.inf
    """When this process last woke from a stall."""

    @property
    def grace_s(self) -> float:
        return min(self.interval_s * ZOMBIE_GRACE_SHARE, ZOMBIE_GRACE_MAX_S)

    def start(self, now: float) -> None:
        self.acked = True
        self.next_at = now + self.interval_s * self.random.random()

    def zombie_at(self) -> float:
        """When the unacknowledged beat makes the connection a zombie (see the class)."""
        bound = self.sent_at + self.interval_s * BACKLOG_INTERVALS
        evidence = min(max(self.heard_at, self.stalled_until), bound)
        return max(self.next_at, evidence) + self.grace_s

    def wake_at(self) -> float:
        """When :meth:`due` may next say something but ``"wait"``."""
        return self.next_at if self.acked else self.zombie_at()

    def due(self, now: float) -> Literal["wait", "beat", "zombie"]:
        if now < self.next_at:
            return "wait"
        if self.acked:
            return "beat"
        return "zombie" if now >= self.zombie_at() else "wait"

    def sent(self, now: float) -> None:
        self.acked = False
        self.sent_at = now
        self.next_at = now + self.interval_s

    def ack(self) -> None:
        self.acked = True

    def heard(self, now: float) -> None:
        """A frame was read."""
        self.heard_at = now

    def stalled(self, now: float) -> None:
        """This process did not run until ``now`` (its timer woke late)."""
        self.stalled_until = now


@attrs.frozen
class StartLimit:
    """``session_start_limit`` of ``GET /gateway/bot``."""

    total: int
    remaining: int
    reset_after_ms: int
    max_concurrency: int

    @classmethod
    def from_json(cls, value: object) -> StartLimit | None:
        if not isinstance(value, Mapping):
            return None
        fields: list[int] = []
        for name in ("total", "remaining", "reset_after", "max_concurrency"):
            field = json_number(value.get(name))
            if field is None or field < 0:
                return None
            fields.append(int(field))
        total, remaining, reset_after, concurrency = fields
        return cls(total, remaining, reset_after, max(1, concurrency))


MIN_IDENTIFY_SPACING_MS = 5_000
"""One identify per 5 s per shard bucket (max_concurrency per 5 s)."""
DAILY_WINDOW_MS = 24 * 3600 * 1000


def identify_wait_ms(
    *,
    now_ms: int,
    history: Sequence[int],
    limit: StartLimit | None,
    own_daily_cap: int,
    spacing_ms: int = MIN_IDENTIFY_SPACING_MS,
) -> int:
    """How long to wait before the next Identify may be sent (0: now).

    ``history`` is the stored times of this shard's recent identifies (durable, so a crash
    loop sees every earlier one). Three rules, the strictest wins:

    * at least 5 s since the last one (the ``max_concurrency`` window), doubling with each
      identify of the last hour (5, 10, 20 … capped at 15 min) so a loop that keeps losing
      its session slows down;
    * at most ``own_daily_cap`` in 24 h for this shard;
    * Discord's ``remaining`` kept above a tenth of its ``total``: below that, wait for
      ``reset_after`` (the 1,000-a-day limit resets the token when it runs out).
    """
    recent = sorted(t for t in history if now_ms - t < DAILY_WINDOW_MS)
    wait = 0
    if recent:
        last_hour = sum(1 for t in recent if now_ms - t < 3_600_000)
        spacing = min(spacing_ms * 2 ** max(0, last_hour - 1), 900_000)
        wait = max(wait, recent[-1] + spacing - now_ms)
    if len(recent) >= own_daily_cap:
        wait = max(wait, recent[len(recent) - own_daily_cap] + DAILY_WINDOW_MS - now_ms)
    if limit is not None and limit.remaining <= max(1, limit.total // 10):
        wait = max(wait, limit.reset_after_ms)
    return max(0, wait)


FORWARD = 1
"""``message_reference.type`` of a forwarded message (0, the default, is a reply)."""


def forwarded(message: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The message a forward carries (its first ``message_snapshots`` entry's ``message``),
    or ``None`` when ``message`` is no forward."""
    reference = message.get("message_reference")
    snapshots = message.get("message_snapshots")
    if not isinstance(reference, Mapping) or reference.get("type") != FORWARD:
        return None
    first = snapshots[0] if isinstance(snapshots, list) and snapshots else None
    inner = first.get("message") if isinstance(first, Mapping) else None
    return inner if isinstance(inner, Mapping) else None


def strip_mention(content: str, bot_user_id: str) -> tuple[str, bool]:
    """``content`` without the bot's own ``<@id>`` / ``<@!id>`` mentions, and whether there
    was one."""
    found = False
    for form in (f"<@{bot_user_id}>", f"<@!{bot_user_id}>"):
        if form in content:
            found = True
            content = content.replace(form, " ")
    return " ".join(content.split(" ")).strip() if found else content, found
