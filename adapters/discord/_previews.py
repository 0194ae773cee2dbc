"""Streaming previews: one message per conversation, edited at most once a second with
the latest text, deleted when the final reply goes out (never journaled).

Latest wins: :meth:`PreviewEditor.offer` never blocks and only keeps the newest text of
each conversation; :meth:`PreviewEditor.run` posts the preview message once and then edits
it (``PATCH``) no more often than :data:`MIN_INTERVAL_S`. :meth:`PreviewEditor.finish`
(called before a final reply is sent) forgets the conversation's preview and deletes its
message (tried again after a 5xx or a lost answer), so the reply — sent with its nonce as
always — replaces it. A preview whose POST got no answer (or a 5xx) may exist without our
knowing its id: it is posted again with its nonce — Discord answers with the message it
made, if it did — and deleted, never left beside the reply. Every failure is ignored: a
preview is a courtesy, the reply is what counts.
"""

from __future__ import annotations

import secrets

import attrs
import trio

from prismd.channel import Preview

from ._rest import DiscordApiError, DiscordError, DiscordRest

MIN_INTERVAL_S = 1.0
MAX_PREVIEW = 1990
MAX_CONVERSATIONS = 256
DELETE_RETRIES_S = (0.25, 1.0, 0.0)
"""A failed DELETE (5xx, 429, no answer) is tried again after these pauses (three tries)."""


@attrs.define(eq=False)
class _Shown:
    message_id: str | None = None
    nonce: str = attrs.field(factory=lambda: secrets.token_hex(8))
    """One per preview: a POST whose answer was lost is posted again with it, and Discord
    returns the message it made (never a second preview, left behind undeleted)."""
    text: str = ""
    unsure: str | None = None
    """The text of a POST whose outcome is unknown (no answer, a 5xx) while the message's id
    is not known: it may exist."""
    sent_at: float = -1e9
    pending: str | None = None


@attrs.define(eq=False, kw_only=True)
class PreviewEditor:
    connection_id: str
    rest: DiscordRest
    _shown: dict[str, _Shown] = attrs.field(factory=dict, init=False)
    _wakeup: trio.Event = attrs.field(factory=trio.Event, init=False)
    _running: bool = attrs.field(default=False, init=False)
    _lock: trio.Lock = attrs.field(factory=trio.Lock, init=False)

    def offer(self, preview: Preview) -> None:
        conversation = preview.external_conversation_id
        if not self._running or preview.connection_id != self.connection_id:
            return
        if not conversation.isdigit() or not preview.text.strip():
            return
        shown = self._shown.get(conversation)
        if shown is None:
            if len(self._shown) >= MAX_CONVERSATIONS:
                return
            shown = self._shown[conversation] = _Shown()
        text = preview.text
        shown.pending = text if len(text) <= MAX_PREVIEW else text[:MAX_PREVIEW] + "…"
        self._wakeup.set()

    async def finish(self, conversation: str) -> None:
        """The final reply is about to go out: delete the preview message, if any."""
        shown = self._shown.pop(conversation, None)
        async with self._lock:  # an edit in flight ends first
            if shown is None or (shown.message_id is None and shown.unsure is None):
                return
            for delay in DELETE_RETRIES_S:  # deleting twice is safe: a 10008 then
                try:
                    if shown.message_id is None and shown.unsure is not None:
                        # Posted perhaps: the same nonce again names the message if it was.
                        await self._post(conversation, shown, shown.unsure)
                    if shown.message_id is None:
                        return
                    path = f"/channels/{conversation}/messages/{shown.message_id}"
                    await self.rest.request("DELETE", path)
                    return
                except DiscordApiError as error:
                    if error.status < 500 and error.status != 429:
                        return  # gone already (10008), or not ours to delete
                except DiscordError:
                    pass
                await trio.sleep(delay)

    async def run(self) -> None:
        self._running = True
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup = trio.Event()
                while True:
                    now = trio.current_time()
                    due = [
                        (c, s)
                        for c, s in list(self._shown.items())
                        if s.pending is not None and s.pending != s.text
                    ]
                    if not due:
                        break
                    ready = [(c, s) for c, s in due if now - s.sent_at >= MIN_INTERVAL_S]
                    if not ready:
                        wait = min(s.sent_at + MIN_INTERVAL_S - now for _c, s in due)
                        await trio.sleep(max(wait, 0.01))
                        continue
                    for conversation, shown in ready:
                        await self._show(conversation, shown)
        finally:
            self._running = False
            self._shown.clear()

    async def _show(self, conversation: str, shown: _Shown) -> None:
        text, shown.pending = shown.pending, None
        if text is None:
            return
        async with self._lock:
            if self._shown.get(conversation) is not shown:
                return  # finished meanwhile
            shown.sent_at = trio.current_time()
            try:
                if shown.message_id is None:
                    await self._post(conversation, shown, text)
                else:
                    await self.rest.request(
                        "PATCH",
                        f"/channels/{conversation}/messages/{shown.message_id}",
                        json_body={"content": text},
                    )
                shown.text = text
            except DiscordError:
                return

    async def _post(self, conversation: str, shown: _Shown, text: str) -> None:
        """POST the preview (its nonce): its id learnt, or :attr:`_Shown.unsure` kept
        when the outcome is unknown."""
        body = {
            "content": text,
            "nonce": shown.nonce,
            "enforce_nonce": True,
            "allowed_mentions": {"parse": []},
        }
        try:
            message = await self.rest.request(
                "POST", f"/channels/{conversation}/messages", json_body=body
            )
        except DiscordApiError as error:
            if error.status >= 500:
                shown.unsure = text
            raise
        except DiscordError:
            shown.unsure = text  # no answer: it may have been made
            raise
        if isinstance(message, dict) and isinstance(message.get("id"), str):
            shown.message_id = message["id"]
            shown.unsure = None
