"""One update from Telegram to ``admit``: parse, answer a callback query, enrich, admit.

Shared by polling and the webhook; the only thing either asks of it is :meth:`process`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import trio

from prismd.channel import Admit

from ._api import TelegramApi, TelegramApiError, TelegramError, log_retry
from ._parse import TelegramMedia, parse_update


@attrs.define(eq=False, kw_only=True)
class UpdateHandler:
    connection_id: str
    admit: Admit
    api: TelegramApi
    """The receiving client (``answerCallbackQuery``)."""
    media: TelegramMedia
    allow_groups: bool = False
    bot_username: str | None = None
    """Learnt from ``getMe`` by the receiver; ``/cmd@other_bot`` is ignored once known."""

    async def process(self, update: Mapping[str, Any], *, strict: bool) -> bool:
        """Answer, parse, enrich and admit one update. True = acknowledge it (the
        admission is final, or there was nothing to admit).

        ``strict`` (webhook): a failed ``answerCallbackQuery`` raises so Telegram retries.
        """
        return await self.admit_update(update, strict=strict) is None

    async def admit_update(self, update: Mapping[str, Any], *, strict: bool) -> str | None:
        """:meth:`process`, answering ``None`` to acknowledge or the retryable admission's
        reason (``capacity``, ``unavailable``, ``stopped``) to try again later."""
        parsed = parse_update(
            update,
            connection_id=self.connection_id,
            allow_groups=self.allow_groups,
            bot_username=self.bot_username,
        )
        if parsed is None:
            return None
        if parsed.callback_query_id is not None:
            await self._answer_callback(parsed.callback_query_id, strict=strict)
        if parsed.event is None:
            return None
        admission = await self.admit(await self.media.enrich(parsed.event))
        return (admission.reason or "denied") if admission.retryable else None

    async def _answer_callback(self, query_id: str, *, strict: bool) -> None:
        for attempt in range(2):
            try:
                await self.api.call("answerCallbackQuery", {"callback_query_id": query_id})
                return
            except TelegramApiError as error:
                if error.retry_after is None or attempt == 1:
                    if strict:
                        raise
                    return
                delay = min(error.retry_after, 60)
                log_retry(self.connection_id, "answerCallbackQuery", error, delay, attempt + 1)
                await trio.sleep(delay)
            except TelegramError:
                if strict:
                    raise
                return
