"""The Discord channel (a bot account): gateway, REST, replies never posted twice.

:class:`DiscordAdapter` (:mod:`._adapter`) wires :mod:`._gateway` (one shard's connection
loop under its receiver lease), :mod:`._protocol` (the gateway protocol without I/O),
:mod:`._cursor` (the shard's durable session and watermark), :mod:`._backfill` (REST
recovery after a session that could not be resumed), :mod:`._sweep` (REST reads of known
channels for what a live session never sent), :mod:`._parse` (message → event),
:mod:`._send` (chunks, nonces, the send window) and :mod:`._rest` (the REST client with
rate limits); :mod:`._kind` is the connection kind.
"""

from ._adapter import DiscordAdapter as DiscordAdapter
from ._adapter import default_intents as default_intents
from ._kind import KIND as KIND
from ._kind import DiscordConnectionConfig as DiscordConnectionConfig
from ._rest import DiscordApiError as DiscordApiError
from ._rest import DiscordError as DiscordError
from ._rest import DiscordRest as DiscordRest
from ._send import chunk_markdown as chunk_markdown

__all__ = ["KIND", "DiscordAdapter", "DiscordConnectionConfig", "chunk_markdown", "default_intents"]
