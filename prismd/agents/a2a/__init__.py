"""The ``a2a`` agent kind: remote agents over the A2A protocol (``docs/a2a.md``).

:mod:`._wire` holds both wire dialects (sans-IO), :mod:`._client` the JSON-RPC client over
httpx; the agent kind and its durable following build on them.
"""

from ._agent import A2AAgent as A2AAgent
from ._agent import cancel_remote as cancel_remote
from ._book import FOLLOWING_CATEGORY as FOLLOWING_CATEGORY
from ._book import NS_CONTEXT as NS_CONTEXT
from ._book import NS_INDEX as NS_INDEX
from ._book import NS_TASK as NS_TASK
from ._book import Book as Book
from ._book import TaskRecord as TaskRecord
from ._book import list_remote_tasks as list_remote_tasks
from ._book import secret_matches as secret_matches
from ._client import A2AClient as A2AClient
from ._client import A2AError as A2AError
from ._client import CardError as CardError
from ._client import OutcomeUnknown as OutcomeUnknown
from ._client import Refused as Refused
from ._client import RemoteError as RemoteError
from ._client import check_url as check_url
from ._client import retry_after_s as retry_after_s
from ._follower import next_poll as next_poll
from ._options import A2AOptions as A2AOptions
from ._options import validate_a2a_options as validate_a2a_options
from ._push import MAX_PUSH_BYTES as MAX_PUSH_BYTES
from ._push import PUSH_SOURCE as PUSH_SOURCE
from ._push import PushReceiver as PushReceiver
from ._push import a2a_statistics as a2a_statistics
from ._steps import NOTICES as NOTICES
from ._steps import reply_text as reply_text
from ._wire import AgentCard as AgentCard
from ._wire import Artifact as Artifact
from ._wire import ArtifactUpdate as ArtifactUpdate
from ._wire import Message as Message
from ._wire import Observation as Observation
from ._wire import PushConfig as PushConfig
from ._wire import StatusUpdate as StatusUpdate
from ._wire import Task as Task
from ._wire import moves_forward as moves_forward
from ._wire import read_card as read_card
from ._wire import read_observation as read_observation
