"""The local web chat channel: the chat page and its WebSocket on one port."""

from ._adapter import WebchatAdapter as WebchatAdapter
from ._adapter import WebchatStatistics as WebchatStatistics
from ._adapter import parse_listen as parse_listen
from ._kind import KIND as KIND
from ._kind import WebchatConnectionConfig as WebchatConnectionConfig
from ._past import Conversations as Conversations
