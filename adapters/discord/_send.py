"""Replies that are never posted twice (reference/discord-protocol.md §4, §8, §9).

* **Chunks** of at most 2,000 characters (counted as UTF-16 units, the stricter count),
  cut at a paragraph, else a line, else a space; a cut inside a fenced code block closes
  the fence and opens it again in the next chunk. Approval controls become lines
  (``Reply /approve TOKEN to allow once.``).
* **One nonce per chunk**, derived from the connection and the staged reply's operation id
  and the chunk index (≤ 25 characters: the same on every instance and after a restart),
  always with ``enforce_nonce: true``, as a reply to the inbound message
  (``message_reference`` with ``fail_if_not_exists: false``; no pings).
* **The window counts from the reply's staging** (``Reply.staged_at_ms``, journaled before
  any attempt) when it is first sent within :data:`UNRECORDED_MS` of it — no write of its
  own; otherwise **the first attempt is stored before the first POST**
  (``prism.channels.v1.discord.send``, create-only under the service scope; no text). A
  timeout, transport error or 5xx is posted again with the same nonce while inside
  :data:`NONCE_WINDOW_MS` of that start — Discord deduplicates and answers with the
  original (a 10008 then means it was delivered and deleted). Outside the window nothing is
  posted blindly: the bot's replies to the inbound message are looked for (``GET
  …/messages?after=<inbound id>``), each chunk by its text (one message may have several
  replies: an approval notice, then the answer); found, the chunk is delivered; not found,
  :class:`~prismd.channel.DeliveryOutcomeUnknownError` (``delivery_unknown`` for the
  operator).
* 50007 (blocked, DMs closed), 50013 (missing permissions), 10003 (unknown channel) and
  other 4xx answers are ``delivery_failed`` with a short reason; 160002 (a reply where the
  bot cannot read the history) is sent again as a plain message, with the same nonce.
"""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

from prismd.channel import (
    Button,
    DeliveryOutcomeUnknownError,
    Reply,
    SendResult,
    button_lines,
)
from stores import CheckpointConflictError, CheckpointStore, Clock, OwnershipScope

from ..toolkit import utf16_units
from ._rest import DiscordApiError, DiscordError, DiscordGuardError, DiscordRest
from ._status import log

MAX_CHUNK = 2000
NONCE_WINDOW_MS = 120_000
"""Discord dedups a nonce for "a few minutes"; we assume at most two."""
UNRECORDED_MS = NONCE_WINDOW_MS // 2
"""A reply first sent within this of being staged stores no first attempt (see
:meth:`DiscordSender._window_start`): one durable write less per reply."""
NOTICE_DEADLINE_S = 10.0
SEND_NAMESPACE = "prism.channels.v1.discord.send"
SEND_CATEGORY = "discord-send"
FAILURE_REASONS: Mapping[int, str] = {
    50007: "cannot message this user (blocked or DMs closed)",
    50013: "missing permissions in this channel",
    10003: "unknown channel",
    50001: "missing access to this channel",
    50083: "thread is archived",
    160005: "thread is locked",
}
_FENCE_RE = re.compile(r"^```([^\s`]{0,16})", re.MULTILINE)
_FENCE_RESERVE = 24


def nonce_base(connection_id: str, operation_id: str) -> str:
    """20 characters naming one staged reply (the chunk index is appended)."""
    digest = hashlib.sha256(f"{connection_id}\0{operation_id}".encode()).digest()
    # 15 bytes are 24 base32 characters, the first 20 those of the whole digest's encoding
    # (each 5 bytes encode alone).
    return base64.b32encode(digest[:15]).decode().lower()[:20]


def chunk_nonce(base: str, index: int) -> str:
    return f"{base}.{index}"


def _prefix_within(text: str, budget: int) -> int:
    """The length (code points) of the longest prefix of ``text`` within ``budget`` units."""
    units = 0
    for i, char in enumerate(text):
        units += 2 if ord(char) > 0xFFFF else 1
        if units > budget:
            return i
    return len(text)


def chunk_markdown(text: str, limit: int = MAX_CHUNK) -> list[str]:
    """``text`` in chunks of at most ``limit`` UTF-16 units, cut on Markdown-safe
    boundaries (see the module docstring); ``[]`` for blank text."""
    chunks: list[str] = []
    reopen = ""
    rest = text
    while rest:
        body = reopen + rest
        if utf16_units(body) <= limit:
            chunks.append(body)
            break
        cut = _prefix_within(body, limit - _FENCE_RESERVE)
        window = body[:cut]
        for sep in ("\n\n", "\n", " "):
            at = window.rfind(sep)
            if at > len(reopen) + cut // 4:
                cut = at + len(sep)
                break
        chunk, consumed = body[:cut], cut - len(reopen)
        fences = _FENCE_RE.findall(chunk)
        reopen = ""
        if len(fences) % 2 == 1:
            reopen = f"```{fences[-1]}\n"
            chunk = chunk.rstrip("\n") + "\n```"
        chunks.append(chunk)
        rest = rest[consumed:]
    return [c for c in chunks if c.strip()]


def render(text: str, buttons: Sequence[Button]) -> list[str] | None:
    """The chunks to send; ``None`` for controls that cannot be rendered."""
    lines = button_lines(buttons)
    if lines is None:
        return None
    body = text if text.strip() else ""
    if lines:
        body = (body + "\n\n" if body else "") + "\n".join(lines)
    return chunk_markdown(body)


@attrs.define(eq=False, kw_only=True)
class DiscordSender:
    connection_id: str
    rest: DiscordRest
    checkpoints: CheckpointStore
    scope: OwnershipScope
    clock: Clock
    bot_user_id: Callable[[], str | None]
    """The bot's user id once known (READY or ``GET /users/@me``)."""
    retry_base_s: float = 0.5

    async def send(self, reply: Reply) -> SendResult:
        channel = reply.external_conversation_id
        if not channel.isdigit() or len(channel) > 20:
            return SendResult(False, reason="invalid_destination")
        chunks = render(reply.text, reply.buttons)
        if chunks is None:
            return SendResult(False, reason="invalid_controls")
        if not chunks:
            return SendResult(False, reason="empty_reply")
        target = reply.in_reply_to if reply.in_reply_to and reply.in_reply_to.isdigit() else None
        operation = reply.operation_id or secrets.token_hex(16)
        base = nonce_base(self.connection_id, operation)
        first_ms, resumed = await self._window_start(reply.staged_at_ms, base, len(chunks))
        if resumed and self.clock.now_ms() - first_ms >= NONCE_WINDOW_MS:
            found = await self._find_replies(channel, target, chunks)
            if all(found):
                return SendResult(True, message_id=found[0])
            raise DeliveryOutcomeUnknownError("reply may have been posted; nonce window passed")
        ids: list[str] = []
        for index, chunk in enumerate(chunks):
            body: dict[str, Any] = {
                "content": chunk,
                "nonce": chunk_nonce(base, index),
                "enforce_nonce": True,
                "allowed_mentions": {"parse": []},
            }
            if target is not None:
                body["message_reference"] = {"message_id": target, "fail_if_not_exists": False}
            outcome = await self._post(channel, target, body, first_ms, index)
            if isinstance(outcome, SendResult):
                if ids:  # part of the reply went out: say so, it is not a clean failure
                    return SendResult(False, message_id=ids[0], reason=outcome.reason)
                return outcome
            ids.append(outcome)
        return SendResult(True, message_id=ids[0])

    async def _post(
        self,
        channel: str,
        target: str | None,
        body: Mapping[str, Any],
        first_ms: int,
        index: int,
    ) -> str | SendResult:
        """The posted chunk's message id, or a definite failure."""
        delay = self.retry_base_s
        while True:
            # Never posted after the window (a rate limit's wait included): see _rest.
            left_s = (first_ms + NONCE_WINDOW_MS - self.clock.now_ms()) / 1000
            try:
                message = await self.rest.request(
                    "POST",
                    f"/channels/{channel}/messages",
                    json_body=body,
                    not_after=trio.current_time() + left_s,
                )
            except DiscordApiError as error:
                if error.code == 10008:
                    return "deleted"  # delivered under this nonce, then deleted
                if error.code == 160002 and "message_reference" in body:
                    # No READ_MESSAGE_HISTORY here: the chunk as a plain message (same nonce).
                    body = {k: v for k, v in body.items() if k != "message_reference"}
                    continue
                if error.status < 500 and error.status != 429:
                    reason = FAILURE_REASONS.get(error.code or 0)
                    return SendResult(
                        False, reason=reason or f"discord error {error.code or error.status}"
                    )
                kind = f"HTTP {error.status}"
            except DiscordGuardError:
                return SendResult(False, reason="rate-limit guard: too many refused requests")
            except DiscordError as error:
                kind = type(error).__name__
            else:
                message_id = message.get("id") if isinstance(message, Mapping) else None
                return str(message_id) if message_id is not None else "unknown"
            # Ambiguous: the message may exist. Same nonce again while inside the window.
            left_ms = first_ms + NONCE_WINDOW_MS - self.clock.now_ms()
            if left_ms <= delay * 1000:
                [found] = await self._find_replies(channel, target, [body["content"]])
                if found is not None:
                    return found
                raise DeliveryOutcomeUnknownError("send outcome unknown; nonce window passed")
            log.warning(
                "discord %s: send failed (%s); posting again with the same nonce in %.1f s",
                self.connection_id,
                kind,
                delay,
            )
            await trio.sleep(delay)
            delay = min(delay * 2, 15.0)

    async def _window_start(
        self, staged_ms: int | None, base: str, chunks: int
    ) -> tuple[int, bool]:
        """Whence the nonce window counts, and whether an earlier attempt may exist.

        A reply staged less than :data:`UNRECORDED_MS` ago needs no record: every attempt
        at it, ours or a dead process's, came after it was staged, so counted from then the
        window still holds and the nonce deduplicates. Otherwise the first attempt is
        stored (:meth:`_first_attempt`), and with the staging time known an attempt that
        left no record may have been made since: the window counts from the earlier of
        the two, and past it, with no record found, the reply is looked for as after a
        restart (never posted blindly).
        """
        now = self.clock.now_ms()
        if isinstance(staged_ms, int) and 0 <= now - staged_ms < UNRECORDED_MS:
            return staged_ms, False
        first_ms, resumed = await self._first_attempt(base, chunks)
        if not isinstance(staged_ms, int) or staged_ms > first_ms:
            return first_ms, resumed
        return staged_ms, resumed or now - staged_ms >= NONCE_WINDOW_MS

    async def _first_attempt(self, base: str, chunks: int) -> tuple[int, bool]:
        """The stored first attempt (ms) and whether it was stored before this call."""
        key = f"s1:{self.connection_id}:{base}"
        now = self.clock.now_ms()
        try:
            await self.checkpoints.save_checkpoint(
                namespace=SEND_NAMESPACE,
                key=key,
                scope=self.scope,
                version=1,
                expected_version=0,
                value={"firstAttemptMs": now, "chunks": chunks},
                category=SEND_CATEGORY,
            )
            return now, False
        except CheckpointConflictError:
            record = await self.checkpoints.load_checkpoint(
                namespace=SEND_NAMESPACE, key=key, scope=self.scope
            )
        value = record.value if record is not None else None
        first = value.get("firstAttemptMs") if isinstance(value, Mapping) else None
        if not isinstance(first, int):
            raise DeliveryOutcomeUnknownError("stored send attempt unreadable")
        return first, True

    async def prune(self, *, keep_ms: int, pages: int = 4) -> int:
        """Delete stored first attempts older than ``keep_ms`` (the journal's retention:
        a reply older than that can no longer be resent); bounded to ``pages`` pages of
        500 a call. How many were deleted."""
        cutoff = self.clock.now_ms() - keep_ms
        deleted = 0
        cursor: str | None = None
        for _page in range(pages):
            page = await self.checkpoints.list_checkpoints(
                namespace=SEND_NAMESPACE, scope=self.scope, cursor=cursor, limit=500
            )
            for record in page.items:
                value = record.value
                first = value.get("firstAttemptMs") if isinstance(value, Mapping) else None
                if record.scope == self.scope and isinstance(first, int) and first < cutoff:
                    removed = await self.checkpoints.delete_checkpoint(
                        namespace=SEND_NAMESPACE, key=record.key, scope=self.scope
                    )
                    deleted += int(removed)
            cursor = page.next_cursor
            if cursor is None or not page.items:
                break
        return deleted

    async def _find_replies(
        self, channel: str, target: str | None, chunks: Sequence[str]
    ) -> list[str | None]:
        """Per chunk, the id of the bot's oldest reply to ``target`` in ``channel`` with
        that text (``None``: none found). A message may have several replies (an approval
        notice, then the answer): only the text tells this one's."""
        bot = self.bot_user_id()
        if target is None or bot is None:
            return [None] * len(chunks)
        found: list[tuple[int, str, str]] = []
        after = target
        for _page in range(5):
            try:
                batch = await self.rest.request(
                    "GET", f"/channels/{channel}/messages", params={"after": after, "limit": 100}
                )
            except DiscordError:
                raise DeliveryOutcomeUnknownError("could not look for the reply") from None
            if not isinstance(batch, list) or not batch:
                break
            for message in batch:
                if not isinstance(message, Mapping) or not str(message.get("id", "")).isdigit():
                    continue
                author = message.get("author")
                reference = message.get("message_reference")
                if (
                    isinstance(author, Mapping)
                    and author.get("id") == bot
                    and isinstance(reference, Mapping)
                    and reference.get("message_id") == target
                ):
                    content = message.get("content")
                    text = content.strip() if isinstance(content, str) else ""
                    found.append((int(message["id"]), str(message["id"]), text))
            after = str(max(int(m["id"]) for m in batch if str(m.get("id", "")).isdigit()))
            if len(batch) < 100:
                break
        found.sort()
        ids: list[str | None] = []
        for chunk in chunks:
            hit = next((i for _n, i, t in found if t == chunk.strip() and i not in ids), None)
            ids.append(hit)
        return ids

    async def notice(self, channel: str, message_id: str, text: str) -> None:
        """Answer ``message_id`` with a fixed notice (a refusal's hint), outside the journal:
        its nonce is derived from the message, so a dispatch seen twice within the window
        posts it once — and a 5xx, 429 or lost answer is posted again with it, for up to
        :data:`NOTICE_DEADLINE_S` (nothing else answers the message). Failures are logged
        and dropped."""
        body = {
            "content": text[:MAX_CHUNK],
            "nonce": chunk_nonce(nonce_base(self.connection_id, f"notice:{message_id}"), 0),
            "enforce_nonce": True,
            "allowed_mentions": {"parse": []},
            "message_reference": {"message_id": message_id, "fail_if_not_exists": False},
        }
        with trio.move_on_after(NOTICE_DEADLINE_S):
            try:
                outcome = await self._post(channel, message_id, body, self.clock.now_ms(), 0)
            except (DiscordError, DeliveryOutcomeUnknownError) as error:
                log.info("discord %s: notice not sent (%s)", self.connection_id, error)
            else:
                if isinstance(outcome, SendResult):
                    log.info("discord %s: notice not sent (%s)", self.connection_id, outcome.reason)

    async def typing(self, channel: str) -> None:
        if not channel.isdigit():
            return
        try:
            await self.rest.request("POST", f"/channels/{channel}/typing")
        except DiscordError:
            return
