"""Files that go with a reply (:meth:`TelegramAdapter.send_file`): ``sendPhoto`` for a JPEG
or PNG image, ``sendDocument`` for anything else, as ``multipart/form-data`` uploads.

Outcomes as for text (:mod:`._send`): delivered, a known failure (nothing was posted), or
:class:`~prismd.channel.DeliveryOutcomeUnknownError` when the file may have been posted. A
rate limit is waited out and the upload made again (bounded). Neither the file's name nor
its bytes reach a log or an exception.
"""

from __future__ import annotations

from typing import Any

import trio

from prismd.channel import DeliveryOutcomeUnknownError, OutboundFile, Reply, SendResult

from ._api import TelegramApi, TelegramApiError, TelegramCredentialError, log_retry

MAX_DOCUMENT_BYTES = 50 * 1024 * 1024
"""What a bot may upload with ``sendDocument``."""
MAX_PHOTO_BYTES = 10 * 1024 * 1024
"""What a bot may upload with ``sendPhoto``; a larger image goes as a document."""
PHOTO_TYPES = frozenset({"image/jpeg", "image/png"})
MAX_UPLOAD_ATTEMPTS = 3
MAX_NAME_CHARS = 128


def upload_name(name: str) -> str:
    """The file name as uploaded: no control characters, quotes or path, bounded."""
    cleaned = "".join(c for c in name if c.isprintable() and c not in '"\\/')
    return cleaned.strip()[:MAX_NAME_CHARS] or "file"


async def send_file(
    api: TelegramApi, connection_id: str, reply: Reply, file: OutboundFile
) -> SendResult:
    """Upload ``file`` to ``reply``'s chat (and topic); see the module for outcomes."""
    if reply.connection_id != connection_id or not reply.external_conversation_id:
        return SendResult(delivered=False, reason="invalid_destination")
    if not file.data:
        return SendResult(delivered=False, reason="empty_file")
    if len(file.data) > MAX_DOCUMENT_BYTES:
        return SendResult(delivered=False, reason="file_too_large")
    media = (file.media_type or "").split(";")[0].strip().lower()
    photo = media in PHOTO_TYPES and len(file.data) <= MAX_PHOTO_BYTES
    method, field = ("sendPhoto", "photo") if photo else ("sendDocument", "document")
    params: dict[str, Any] = {"chat_id": reply.external_conversation_id}
    if reply.thread_id is not None:
        params["message_thread_id"] = reply.thread_id
    upload = {field: (upload_name(file.name), file.data, media or "application/octet-stream")}
    for attempt in range(1, MAX_UPLOAD_ATTEMPTS + 1):
        try:
            result = await api.call(method, params, files=upload)
        except TelegramApiError as error:
            if not error.enveloped and error.status >= 500:
                raise DeliveryOutcomeUnknownError("Telegram delivery outcome unknown") from None
            if error.retry_after is not None and attempt < MAX_UPLOAD_ATTEMPTS:
                delay = min(error.retry_after, 3600)
                log_retry(connection_id, method, error, delay, attempt)
                await trio.sleep(delay)
                continue
            reason = {
                401: "telegram_unauthorized",
                403: "telegram_forbidden",
                413: "file_too_large",
                429: "telegram_rate_limited",
            }.get(error.status, "telegram_api_error")
            return SendResult(delivered=False, reason=reason)
        except TelegramCredentialError:
            return SendResult(delivered=False, reason="telegram_credential")
        except Exception:  # a network error or an unreadable answer: it may be posted
            raise DeliveryOutcomeUnknownError("Telegram delivery outcome unknown") from None
        message_id = result.get("message_id") if isinstance(result, dict) else None
        return SendResult(
            delivered=True, message_id=str(message_id) if isinstance(message_id, int) else None
        )
    raise AssertionError("unreachable")
