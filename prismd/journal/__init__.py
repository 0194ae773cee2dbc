"""The channel journal: namespaces, keys and records of contract §5 over a CheckpointStore,
and the access records kept beside them (approval controls, pairing tokens, paired grants)."""

from ._access import NS_CONTROL as NS_CONTROL
from ._access import PAIRING_TTL_MAX_MS as PAIRING_TTL_MAX_MS
from ._access import PAIRING_TTL_MIN_MS as PAIRING_TTL_MIN_MS
from ._access import ApprovalRecord as ApprovalRecord
from ._access import ApprovalStore as ApprovalStore
from ._access import ApprovalTarget as ApprovalTarget
from ._access import GrantRecord as GrantRecord
from ._access import GrantStore as GrantStore
from ._access import LoadedApproval as LoadedApproval
from ._access import PairingStore as PairingStore
from ._access import new_token as new_token
from ._access import token_hash as token_hash
from ._journal import NS_BINDING as NS_BINDING
from ._journal import NS_CURSOR as NS_CURSOR
from ._journal import NS_OPERATION as NS_OPERATION
from ._journal import NS_REPLY as NS_REPLY
from ._journal import UNRESOLVED_OPERATION_STATES as UNRESOLVED_OPERATION_STATES
from ._journal import UNRESOLVED_REPLY_STATES as UNRESOLVED_REPLY_STATES
from ._journal import UNSETTLED_REPLY_STATES as UNSETTLED_REPLY_STATES
from ._journal import BindingRecord as BindingRecord
from ._journal import ChannelJournal as ChannelJournal
from ._journal import CursorRecord as CursorRecord
from ._journal import InputAttachment as InputAttachment
from ._journal import Loaded as Loaded
from ._journal import OperationInput as OperationInput
from ._journal import OperationRecord as OperationRecord
from ._journal import ReplyRecord as ReplyRecord
from ._journal import StoredControl as StoredControl
from ._journal import SuspendedRun as SuspendedRun
from ._journal import binding_actor_prefix as binding_actor_prefix
from ._journal import binding_key as binding_key
from ._journal import bounded_claims as bounded_claims
from ._journal import cursor_key as cursor_key
from ._journal import operation_key as operation_key
from ._journal import reply_key as reply_key
