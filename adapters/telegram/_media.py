"""Attachments: fetching a file by its ref, and the §11.5 hooks that turn voice notes and
documents into text before admission."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping

import attrs
import trio

from prismd.channel import AttachmentRef, InboundEvent
from prismd.redact import utf8_len

from ._api import TelegramApi, TelegramError
from ._parse import _bounded_str

MAX_ATTACHMENT_BYTES_CAP = 4 * 1024 * 1024
FETCH_DEADLINE_S = 60.0
"""Whole-fetch deadline of :meth:`TelegramMedia.fetch` (getFile + download)."""
_FILE_SEGMENT_RE = re.compile(r"^[A-Za-z0-9._-]+$")

Transcribe = Callable[[bytes, str], Awaitable[str | None]]
"""``transcribe(audio, mime_type) -> text``."""
ExtractDocumentText = Callable[[bytes, str], Awaitable[str | None]]
"""``extract_document_text(data, mime_type) -> text``."""


@attrs.frozen
class FetchedAttachment:
    data: bytes = attrs.field(repr=False)
    mime_type: str | None = None
    file_name: str | None = None


def _valid_file_path(path: object) -> bool:
    if not isinstance(path, str) or not path or utf8_len(path) > 256:
        return False
    segments = path.split("/")
    return len(segments) <= 4 and all(
        _FILE_SEGMENT_RE.fullmatch(s) and s not in (".", "..") for s in segments
    )


@attrs.define(eq=False, kw_only=True)
class TelegramMedia:
    """Files of one bot, fetched over ``api`` within ``max_attachment_bytes``."""

    connection_id: str
    api: TelegramApi
    max_attachment_bytes: int
    transcribe: Transcribe | None = None
    extract_document_text: ExtractDocumentText | None = None
    stopped: bool = False

    async def fetch(self, ref: AttachmentRef) -> FetchedAttachment | None:
        """The file's bytes, or ``None`` (stopped, bad ref, another connection's ref, too
        large, any failure).

        The size cap is enforced from ``getFile``'s ``file_size`` (else the ref's) before
        downloading, then from ``Content-Length`` and while streaming. Redirects are refused.
        """
        if self.stopped or not isinstance(ref, AttachmentRef):
            return None
        if ref.connection_id is not None and ref.connection_id != self.connection_id:
            return None  # another bot's file id means nothing to this one
        if ref.kind not in ("image", "document", "voice"):
            return None
        file_id = ref.transport_file_id
        if _bounded_str(file_id, 256) is None:
            return None
        length = ref.byte_length
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            return None
        data: bytes | None = None
        # One deadline for both requests: httpx's timeouts bound each read, not the whole
        # download, and a server dripping bytes would otherwise hold the poller indefinitely.
        with trio.move_on_after(FETCH_DEADLINE_S):
            try:
                info = await self.api.call("getFile", {"file_id": file_id})
                if not isinstance(info, Mapping) or not _valid_file_path(info.get("file_path")):
                    return None
                declared = info.get("file_size")
                if isinstance(declared, bool) or not isinstance(declared, int):
                    declared = length
                if declared > self.max_attachment_bytes:
                    return None
                data = await self.api.download(info["file_path"], self.max_attachment_bytes)
            except TelegramError:
                return None
        if data is None:
            return None
        return FetchedAttachment(data=data, mime_type=ref.mime_type, file_name=ref.file_name)

    async def enrich(self, event: InboundEvent) -> InboundEvent:
        """Append transcripts / extracted document text (hooks of §11.5) to the event text."""
        added: list[str] = []
        for ref in event.attachments:
            hook: Callable[[bytes, str], Awaitable[str | None]] | None
            if ref.kind == "voice":
                hook, default_mime = self.transcribe, "audio/ogg"
            elif ref.kind == "document":
                hook, default_mime = self.extract_document_text, "application/octet-stream"
            else:
                continue
            if hook is None:
                continue
            fetched = await self.fetch(ref)
            if fetched is None:
                continue
            try:
                text = await hook(fetched.data, ref.mime_type or default_mime)
            except Exception:
                continue
            if isinstance(text, str) and text.strip():
                added.append(text)
        if not added:
            return event
        parts = [event.text, *added] if event.text.strip() else added
        return attrs.evolve(event, text="\n\n".join(parts))
