"""The Telegram channel (contract §11): Bot API client, update parser, polling and webhook.

:class:`TelegramAdapter` is the adapter; :mod:`._api` the Bot API client, :mod:`._parse` the
update → event mapping, :mod:`._webhook` the webhook server.
"""

from ._adapter import ReceiverLeaseLostError as ReceiverLeaseLostError
from ._adapter import TelegramAdapter as TelegramAdapter
from ._adapter import chunk_text as chunk_text
from ._api import TelegramApi as TelegramApi
from ._api import TelegramApiError as TelegramApiError
from ._api import TelegramCredentialError as TelegramCredentialError
from ._api import TelegramError as TelegramError
from ._parse import ALLOWED_UPDATES as ALLOWED_UPDATES
