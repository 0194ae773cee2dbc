"""Attachments (images) as model input, size-capped before download
(reference/discord-protocol.md §3 "Attachment fields", "Signed Attachment CDN URLs").
Other attachments become ``document`` refs (:func:`document_refs`), never fetched: a
message of nothing else gets the runtime's "cannot be processed" notice, not silence.

* **Refs.** A ``MESSAGE_CREATE``'s image attachments (``content_type`` ``image/…``) become
  :class:`~prismd.channel.AttachmentRef` s named ``<channel>/<message>/<attachment>`` (ids
  only: the signed CDN URL expires, and is never journaled), with the declared ``size``:
  the runtime refuses a message whose attachments are over its cap at admission, and the
  adapter then posts that refusal's fixed notice (``Attachments too large: …``).
* **Fetch.** The message is read again (``GET /channels/{c}/messages/{m}``: fresh signed
  URLs; a forwarded image is in its ``message_snapshots``), the attachment's declared
  ``size`` checked against the cap, its URL checked (https
  on Discord's CDN hosts; on a loopback ``api_origin``, that same host), then downloaded
  without the bot token, the cap checked against ``Content-Length`` and while reading, all
  within :data:`FETCH_DEADLINE_S`. Anything else — another connection's ref, a bad id, too
  large, a failure — is ``None`` (the runtime answers "That attachment cannot be
  processed").
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from typing import Any, Literal

import attrs
import trio

from prismd.channel import AttachmentRef

from ..toolkit import is_loopback_host
from ._protocol import forwarded
from ._rest import DiscordError, DiscordRest

MAX_IMAGES = 8
"""At most this many refs per message (the runtime's limit)."""
FETCH_DEADLINE_S = 60.0
CDN_HOSTS = frozenset({"cdn.discordapp.com", "media.discordapp.net"})
_MAX_NAME = 200
IMAGE_SUFFIXES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg"}
IMAGE_SUFFIXES |= {".gif": "image/gif", ".webp": "image/webp"}
"""An attachment's type by its file name when it has no ``content_type`` (optional, §3)."""


@attrs.frozen
class FetchedAttachment:
    data: bytes = attrs.field(repr=False)
    mime_type: str | None = None
    file_name: str | None = None


def _id(value: object) -> str | None:
    return value if isinstance(value, str) and value.isdigit() and len(value) <= 20 else None


def _text(value: object, limit: int) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= limit else None


def image_refs(message: Mapping[str, Any], connection_id: str) -> tuple[AttachmentRef, ...]:
    """The message's image attachments as refs (see the module docstring)."""
    return _refs(message, connection_id, "image")


def document_refs(message: Mapping[str, Any], connection_id: str) -> tuple[AttachmentRef, ...]:
    """The message's other attachments (a PDF, a sound) as ``document`` refs, never
    fetched: a message of nothing else is answered by the runtime's fixed notice ("That
    attachment cannot be processed …") instead of silence (:func:`._parse.parse_message`)."""
    return _refs(message, connection_id, "document")


def _refs(
    message: Mapping[str, Any], connection_id: str, kind: Literal["image", "document"]
) -> tuple[AttachmentRef, ...]:
    """The attachments of ``kind`` (an image: ``image/…`` by type or file name; a document:
    any other, its type unknown too) with an id and a declared size, at most
    :data:`MAX_IMAGES`."""
    attachments = message.get("attachments")
    channel, message_id = _id(message.get("channel_id")), _id(message.get("id"))
    if not isinstance(attachments, list) or channel is None or message_id is None:
        return ()
    refs: list[AttachmentRef] = []
    for item in attachments:
        if not isinstance(item, Mapping):
            continue
        attachment_id = _id(item.get("id"))
        mime = _text(item.get("content_type"), 100) or _mime_by_name(item.get("filename"))
        size = item.get("size")
        image = mime is not None and mime.startswith("image/")
        if attachment_id is None or image != (kind == "image"):
            continue
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            continue
        refs.append(
            AttachmentRef(
                kind=kind,
                transport_file_id=f"{channel}/{message_id}/{attachment_id}",
                byte_length=size,
                mime_type=mime,
                file_name=_text(item.get("filename"), _MAX_NAME),
                connection_id=connection_id,
            )
        )
        if len(refs) == MAX_IMAGES:
            break
    return tuple(refs)


def _mime_by_name(name: object) -> str | None:
    if not isinstance(name, str):
        return None
    dot = name.rfind(".")
    return IMAGE_SUFFIXES.get(name[dot:].lower()) if dot >= 0 else None


def allowed_url(url: object, api_origin: str) -> str | None:
    """``url`` if it may be fetched: https on Discord's CDN, or (an ``http`` loopback
    ``api_origin``: tests and proxies) http on that same host, any port — as Discord's CDN
    is another host than its API, a Discord on loopback may serve attachments beside it."""
    if not isinstance(url, str) or len(url) > 2048:
        return None
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port  # a bad port raises here
    except ValueError:
        return None
    if parts.scheme == "https" and parts.hostname in CDN_HOSTS and parts.port is None:
        return url
    origin = urllib.parse.urlsplit(api_origin)
    if (
        origin.scheme == "http"
        and parts.scheme == "http"
        and origin.hostname is not None
        and parts.hostname == origin.hostname
        and is_loopback_host(origin.hostname)
    ):
        return url
    return None


@attrs.define(eq=False, kw_only=True)
class DiscordMedia:
    connection_id: str
    rest: DiscordRest
    max_attachment_bytes: int

    async def fetch(self, ref: AttachmentRef) -> FetchedAttachment | None:
        if not isinstance(ref, AttachmentRef) or ref.kind != "image":
            return None
        if ref.connection_id is not None and ref.connection_id != self.connection_id:
            return None  # another bot's attachment
        ids = ref.transport_file_id.split("/")
        if len(ids) != 3 or any(_id(part) is None for part in ids):
            return None
        if ref.byte_length > self.max_attachment_bytes:
            return None
        channel, message_id, attachment_id = ids
        with trio.move_on_after(FETCH_DEADLINE_S):
            try:
                message = await self.rest.request(
                    "GET", f"/channels/{channel}/messages/{message_id}"
                )
                item = _attachment(message, attachment_id)
                if item is None:
                    return None
                size = item.get("size")
                if isinstance(size, bool) or not isinstance(size, int):
                    return None
                if size > self.max_attachment_bytes:
                    return None
                url = allowed_url(item.get("url"), self.rest.api_origin)
                if url is None:
                    return None
                data = await self.rest.download(url, self.max_attachment_bytes)
            except DiscordError:
                return None
            if data is None:
                return None
            return FetchedAttachment(data=data, mime_type=ref.mime_type, file_name=ref.file_name)
        return None


def _attachment(message: object, attachment_id: str) -> Mapping[str, Any] | None:
    """The message's attachment ``attachment_id``: its own, or its forwarded message's
    (:func:`._protocol.forwarded`)."""
    if not isinstance(message, Mapping):
        return None
    for holder in (message, forwarded(message)):
        items = holder.get("attachments") if isinstance(holder, Mapping) else None
        for item in items if isinstance(items, list) else ():
            if isinstance(item, Mapping) and item.get("id") == attachment_id:
                return item
    return None
