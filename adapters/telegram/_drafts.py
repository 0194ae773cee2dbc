"""Streaming previews as ``sendMessageDraft`` (private chats only; never journaled)."""

from __future__ import annotations

from typing import Any

import attrs
import trio

from prismd.channel import Preview

from ._api import TelegramApi, TelegramError
from ._send import MAX_CHUNK_UNITS, tail_units
from ._updates import clean_text


@attrs.define(eq=False, kw_only=True)
class DraftStreamer:
    """Latest-wins preview sender: :meth:`offer` never blocks, :meth:`run` sends."""

    connection_id: str
    api: TelegramApi
    stopped: bool = False
    _draft: Preview | None = attrs.field(default=None, init=False, repr=False)
    _wakeup: trio.Event = attrs.field(factory=trio.Event, init=False, repr=False)
    _running: bool = attrs.field(default=False, init=False)

    def offer(self, preview: Preview) -> None:
        """Queue ``preview`` (replacing a pending one). A no-op unless :meth:`run` is active,
        not stopped, the preview is for this connection and a private chat (ids not
        starting with ``-``)."""
        if (
            self.stopped
            or not self._running
            or preview.connection_id != self.connection_id
            or not preview.external_conversation_id
            or preview.external_conversation_id.startswith("-")
        ):
            return
        self._draft = preview
        self._wakeup.set()

    async def run(self) -> None:
        """Send queued previews one at a time until cancelled; errors are ignored. The text
        is the last 3,500 UTF-16 units."""
        self._running = True
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup = trio.Event()
                preview, self._draft = self._draft, None
                if preview is None or self.stopped:
                    continue
                params: dict[str, Any] = {
                    "chat_id": preview.external_conversation_id,
                    "draft_id": 1,
                    "text": tail_units(clean_text(preview.text), MAX_CHUNK_UNITS),
                }
                if preview.thread_id is not None:
                    params["message_thread_id"] = preview.thread_id
                try:
                    await self.api.call("sendMessageDraft", params)
                except TelegramError:
                    pass
        finally:
            self._running = False
            self._draft = None
