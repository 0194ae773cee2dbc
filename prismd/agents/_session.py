"""Shared pieces of the built-in agents: durable session transcripts, option errors, helpers.

A transcript is the agent's own memory of a conversation (not the channel journal): one
checkpoint per (owner, agent alias, session id) in ``prismd.v1.agent-session``, scoped by
the run's ownership, holding the most recent user/assistant entries within fixed bounds.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from json.encoder import encode_basestring as _json_string
from typing import Any, Literal

import attrs
import trio

from stores import (
    LOST,
    CheckpointRecord,
    CheckpointStore,
    DeleteCheckpoint,
    Lost,
    OwnershipScope,
    SaveCheckpoint,
    compact_json,
    retry_compare_and_swap,
)

from ..channel import replace_surrogates
from ._base import (
    AgentBase,
    AgentInput,
    EventSink,
    ImageBlock,
    StreamEvent,
    TextBlock,
)

NS_SESSION = "prismd.v1.agent-session"
NS_RUN = "prismd.v1.agent-run"
MOVED_NAMESPACES = {
    "prismd.agents.v1.session": NS_SESSION,
    "prismd.agents.v1.run": NS_RUN,
}
"""Where these records were kept before prismd's namespaces took one scheme
(``prismd.v1.<name>``): the journal's format 3 moves them (:func:`prismd.journal.ensure_format`)."""
CATEGORY_SESSION = "agent-session"
CATEGORY_RUN = "agent-run"
MAX_SESSION_ENTRIES = 200
MAX_SESSION_BYTES = 256 * 1024
"""Upper bound of a transcript's JSON: far below every store's 1 MiB value limit."""
MAX_ENTRY_BYTES = 32 * 1024
_CAS_ATTEMPTS = 8


class AgentOptionError(ValueError):
    """An agent option is invalid. ``key`` names it; the message starts with ``<key>:``."""

    def __init__(self, key: str | None, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key


@attrs.frozen
class SessionEntry:
    id: str
    role: Literal["user", "assistant"]
    text: str


def new_run_id() -> str:
    return f"run-{os.urandom(16).hex()}"


def new_entry_id() -> str:
    return f"e-{os.urandom(16).hex()}"


def definition_revision(kind: str, options: Mapping[str, Any]) -> str:
    """A stable hash of kind + options: equal configs give equal revisions across restarts."""
    canonical = json.dumps(
        {"kind": kind, "options": dict(options)}, sort_keys=True, separators=(",", ":"), default=str
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:32]


def input_text(value: AgentInput) -> str:
    """The text of an input: the string itself, or the text blocks joined by newlines."""
    if isinstance(value, str):
        return value
    return "\n".join(block.text for block in value if isinstance(block, TextBlock))


def image_count(value: AgentInput) -> int:
    if isinstance(value, str):
        return 0
    return sum(1 for block in value if isinstance(block, ImageBlock))


_WORD = re.compile(r"\s*\S+|\s+")


async def stream_text(
    run_id: str, text: str, on_event: EventSink | None, *, by_word: bool = True
) -> None:
    """Emit ``message_started``, deltas that concatenate to ``text``, ``message_finished``.

    ``by_word`` streams one delta per word (with its leading space), else one delta.

    Checkpoints between words so a cancelled run stops streaming promptly and other tasks
    run meanwhile. A single delta, or no sink, has nothing to interleave: a cancelled run
    still stops here, but the others do not yield (an agent that keeps a transcript writes
    it next, which does; the runtime's next journal write does anyway).
    """
    if on_event is None:
        await trio.lowlevel.checkpoint_if_cancelled()
        return
    on_event(StreamEvent("message_started", run_id))
    if by_word:
        for piece in _WORD.findall(text):
            await trio.lowlevel.checkpoint()
            on_event(StreamEvent("message_delta", run_id, piece))
    else:
        await trio.lowlevel.checkpoint_if_cancelled()
        if text:
            on_event(StreamEvent("message_delta", run_id, text))
    on_event(StreamEvent("message_finished", run_id, text))


def run_key(alias: str, run_id: str) -> str:
    """A run record's row key in :data:`NS_RUN` (the ``mock`` and ``openai`` kinds')."""
    return f"r1:{alias}:{run_id}"


def session_key(alias: str, session_id: str, scope: OwnershipScope) -> str:
    """A transcript's row key: ``s2:`` and the JSON array ``[tenant, account, user, alias,
    session id]``.

    The owner is part of it because session ids need not be unique across owners (a
    host's ``resolve_binding`` chooses them): two owners with the same session id have a
    transcript each, where one shared row key made the second one's every append lose
    its compare-and-swap.
    """
    return "s2:" + compact_json(
        [scope.tenant_id, scope.account_id, scope.user_id, alias, session_id]
    )


def legacy_session_key(alias: str, session_id: str) -> str:
    """Where transcripts were kept before the owner was part of the key (``s1:``): read
    when the owner's row is missing, and moved to it by the next append."""
    return f"s1:{alias}:{session_id}"


Role = Literal["user", "assistant"]


def _stored_entries(value: object) -> Iterator[tuple[str, Role, str]]:
    """The well-formed entries of a stored transcript, as (id, role, text); the rest is
    skipped."""
    if not isinstance(value, Mapping):
        return
    raw = value.get("entries")
    if not isinstance(raw, list):
        return
    for item in raw:
        if not isinstance(item, Mapping):
            continue
        entry_id, role, text = item.get("id"), item.get("role"), item.get("text")
        if isinstance(entry_id, str) and role in ("user", "assistant") and isinstance(text, str):
            yield entry_id, "user" if role == "user" else "assistant", text


def _parse_entries(value: object) -> list[SessionEntry]:
    return [SessionEntry(*entry) for entry in _stored_entries(value)]


def _entry_json(entry_id: str, role: str, text: str) -> str:
    """``compact_json({"id": entry_id, "role": role, "text": text})``, built from its three
    strings: the encoder's own string function (``ensure_ascii`` off, as
    :func:`~stores.compact_json` has it), one C call each instead of an encoder per entry."""
    return (
        f'{{"id":{_json_string(entry_id)},"role":{_json_string(role)},"text":{_json_string(text)}}}'
    )


def _clip(text: str) -> str:
    """At most :data:`MAX_ENTRY_BYTES` of UTF-8, cut on a code point boundary; lone
    surrogates (which no store can hold as UTF-8) become U+FFFD."""
    text = replace_surrogates(text)
    raw = text.encode("utf-8")
    if len(raw) <= MAX_ENTRY_BYTES:
        return text
    return raw[:MAX_ENTRY_BYTES].decode("utf-8", "ignore")


MAX_CACHED_SESSIONS = 1024
MAX_CACHED_BYTES = 32 * 1024 * 1024
"""Bounds of a :class:`SessionLog`'s memory of the transcripts it last wrote (the bytes an
estimate of what the kept entries occupy in memory, see ``_Transcript.weight``; a full
200-entry transcript of short messages weighs about 100 KB). Past them every turn of a
forgotten transcript reads, parses and re-encodes it whole: with 8 MB, 100 routes with
long transcripts made 394-525 messages/s against 731 with them all remembered."""
_ENTRY_OVERHEAD = 320
"""Bytes a kept entry costs beyond its text, twice over (stored dict, its JSON): the
dict, the id and the objects' headers."""


def _measured(item: Mapping[str, str], compact: str) -> int:
    """The entry's size as escaped ASCII JSON (``json.dumps(item)``, the largest encoding
    any store may use) plus its comma in the list. ``compact`` is its compact encoding:
    when that is ASCII without DEL (which only the escaped form writes as ``\\u007f``),
    the escaped form differs only by the separators' spaces (one after each colon and
    each comma), so nothing is encoded a second time."""
    if compact.isascii() and "\x7f" not in compact:
        return len(compact) + max(0, 2 * len(item) - 1) + 1
    return len(json.dumps(item)) + 1


@attrs.frozen
class _Transcript:
    """A transcript as this process stored it: its version and, per entry, the stored
    dict, its compact JSON and its measured size — so an append costs the new entries,
    not a load, parse and re-encoding of the whole transcript."""

    version: int
    items: tuple[dict[str, str], ...] = ()
    encoded: tuple[str, ...] = ()
    sizes: tuple[int, ...] = ()

    @classmethod
    def stored(cls, version: int, value: object) -> _Transcript:
        """The transcript of a stored value (no :class:`SessionEntry` made on the way)."""
        return cls(version)._with(_stored_entries(value), MAX_SESSION_ENTRIES, version)

    @property
    def weight(self) -> int:
        """Roughly the bytes this memory occupies: each entry's text held twice (the dict
        and its JSON) plus the per-entry objects."""
        return 2 * sum(self.sizes) + _ENTRY_OVERHEAD * len(self.sizes)

    def extended(self, added: list[SessionEntry], max_entries: int, version: int) -> _Transcript:
        """These entries plus ``added``: the last ``max_entries``, then the oldest dropped
        until the JSON fits :data:`MAX_SESSION_BYTES` (the newest always stays)."""
        return self._with(((e.id, e.role, e.text) for e in added), max_entries, version)

    def _with(
        self, added: Iterable[tuple[str, Role, str]], max_entries: int, version: int
    ) -> _Transcript:
        items = list(self.items)
        encoded = list(self.encoded)
        sizes = list(self.sizes)
        for entry_id, role, text in added:
            item = {"id": entry_id, "role": role, "text": text}
            compact = _entry_json(entry_id, role, text)
            items.append(item)
            encoded.append(compact)
            sizes.append(_measured(item, compact))
        start = max(0, len(items) - max_entries)
        total = sum(sizes[start:]) + 16
        while total > MAX_SESSION_BYTES and start < len(items) - 1:
            total -= sizes[start]
            start += 1
        return _Transcript(
            version, tuple(items[start:]), tuple(encoded[start:]), tuple(sizes[start:])
        )

    def value_json(self) -> str:
        return '{"entries":[' + ",".join(self.encoded) + "]}"


@attrs.define(eq=False)
class SessionLog:
    """Durable transcripts of one agent alias, bounded to the last ``max_entries`` (at
    most :data:`MAX_SESSION_ENTRIES`) entries and :data:`MAX_SESSION_BYTES` of JSON (each
    entry's text clipped to :data:`MAX_ENTRY_BYTES`). Appends are CAS-retried.

    The log remembers the transcripts it last wrote (at most :data:`MAX_CACHED_SESSIONS`
    and :data:`MAX_CACHED_BYTES`, least recently used forgotten first) and appends to
    one without loading it: the store's compare-and-swap on the remembered version is
    what makes that safe — if anything else wrote the transcript since (another process,
    a prune), the save conflicts, the memory is dropped and the append reloads.
    """

    checkpoints: CheckpointStore
    alias: str
    max_entries: int = MAX_SESSION_ENTRIES
    """Kept entries (at most :data:`MAX_SESSION_ENTRIES`); the oldest are dropped first."""
    _cache: OrderedDict[tuple[str, OwnershipScope], _Transcript] = attrs.field(
        factory=OrderedDict, init=False
    )
    _cached_bytes: int = attrs.field(default=0, init=False)

    async def entries(self, session_id: str, scope: OwnershipScope) -> tuple[SessionEntry, ...]:
        stored, _legacy = await self._load(session_id, scope)
        return () if stored is None else tuple(_parse_entries(stored.value))

    async def _load(
        self, session_id: str, scope: OwnershipScope
    ) -> tuple[CheckpointRecord | None, bool]:
        """The stored transcript, and whether it is still under its legacy key."""
        for key, legacy in (
            (session_key(self.alias, session_id, scope), False),
            (legacy_session_key(self.alias, session_id), True),
        ):
            stored = await self.checkpoints.load_checkpoint(
                namespace=NS_SESSION, key=key, scope=scope
            )
            if stored is not None:
                return stored, legacy
        return None, False

    def _take(self, at: tuple[str, OwnershipScope]) -> _Transcript | None:
        cached = self._cache.pop(at, None)
        if cached is not None:
            self._cached_bytes -= cached.weight
        return cached

    def _remember(self, at: tuple[str, OwnershipScope], transcript: _Transcript) -> None:
        known = self._take(at)
        if known is not None and known.version > transcript.version:
            transcript = known  # a newer write of ours landed meanwhile
        self._cache[at] = transcript
        self._cached_bytes += transcript.weight
        while self._cache and (
            len(self._cache) > MAX_CACHED_SESSIONS or self._cached_bytes > MAX_CACHED_BYTES
        ):
            _, oldest = self._cache.popitem(last=False)
            self._cached_bytes -= oldest.weight

    async def append(
        self,
        session_id: str,
        scope: OwnershipScope,
        new: tuple[tuple[Literal["user", "assistant"], str], ...],
    ) -> str:
        """Append entries (role, text) and return the id of the last one (the new leaf)."""
        added = [SessionEntry(new_entry_id(), role, _clip(text)) for role, text in new]
        key = session_key(self.alias, session_id, scope)
        at = (key, scope)
        limit = min(self.max_entries, MAX_SESSION_ENTRIES)

        async def attempt() -> str | Lost:
            # Taken out while the save is in flight: a concurrent append of this process
            # loads from the store instead and meets the compare-and-swap.
            current = self._take(at)
            legacy = False
            if current is None:
                stored, legacy = await self._load(session_id, scope)
                current = (
                    _Transcript(0)
                    if stored is None
                    # A legacy row moves: created under the owner's key (version 1).
                    else _Transcript.stored(0 if legacy else stored.version, stored.value)
                )
            version = current.version
            written = current.extended(added, limit, version + 1)
            writes: list[SaveCheckpoint | DeleteCheckpoint] = [
                SaveCheckpoint(
                    NS_SESSION,
                    key,
                    scope,
                    version + 1,
                    expected_version=version,
                    category=CATEGORY_SESSION,
                    value_json=written.value_json(),
                )
            ]
            if legacy:
                # Together or not at all: a legacy row already moved (or pruned) meanwhile
                # is missing, and the append starts over from what is stored now.
                old_key = legacy_session_key(self.alias, session_id)
                writes.append(DeleteCheckpoint(NS_SESSION, old_key, scope))
            result, *_ = await self.checkpoints.write_checkpoints(writes, atomic=True)
            if not result.ok:
                return LOST
            self._remember(at, written)
            return added[-1].id

        return await retry_compare_and_swap(
            attempt, what="the session transcript append", attempts=_CAS_ATTEMPTS
        )


class SessionAgent(AgentBase):
    """What the built-in kinds with a transcript share besides :class:`AgentBase`: the alias
    as the agent id, the definition revision and :meth:`session_entries`."""

    alias: str
    _log: SessionLog
    _revision: str

    @property
    def agent_id(self) -> str:
        return self.alias

    @property
    def definition_revision(self) -> str:
        return self._revision

    async def session_entries(
        self, session_id: str, scope: OwnershipScope
    ) -> tuple[SessionEntry, ...]:
        return await self._log.entries(session_id, scope)
