"""The Telegram channel (contract §11): Bot API client, update parser, polling and webhook.

:class:`TelegramAdapter` is the adapter (:mod:`._adapter`, with its connection kind,
:data:`KIND`), wiring parts of one job each: :mod:`._poller` (long polling, durable
offset), :mod:`._webhook` (the webhook server), :mod:`._inbox` (the webhook's durable
inbox), :mod:`._updates` (one update → event, with the files it refers to, → ``admit``),
:mod:`._send` (replies as Telegram HTML, typing), :mod:`._files` (a reply's files),
:mod:`._drafts` (streaming previews); :mod:`._api` is the Bot API client with the receiving
side's status.
"""

from ..toolkit import LeaseLostError as ReceiverLeaseLostError
from ._adapter import KIND as KIND
from ._adapter import TelegramAdapter as TelegramAdapter
from ._adapter import TelegramConnectionConfig as TelegramConnectionConfig
from ._api import TelegramApi as TelegramApi
from ._api import TelegramApiError as TelegramApiError
from ._api import TelegramCredentialError as TelegramCredentialError
from ._api import TelegramError as TelegramError
from ._send import chunk_text as chunk_text
from ._updates import ALLOWED_UPDATES as ALLOWED_UPDATES

__all__ = [
    "ALLOWED_UPDATES",
    "KIND",
    "ReceiverLeaseLostError",
    "TelegramAdapter",
    "TelegramApi",
    "TelegramApiError",
    "TelegramConnectionConfig",
    "TelegramCredentialError",
    "TelegramError",
    "chunk_text",
]
