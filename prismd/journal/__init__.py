"""The channel journal: namespaces, keys and records of contract §5 over a CheckpointStore,
and the access records kept beside them (approval controls, pairing tokens, paired grants)."""

# What a journal caller needs of the store beneath, named once here so the runtime reads and
# writes through the journal: the scope every record is kept under, a row as listed, the
# store's refusal to answer, and the record's JSON and time formats.
from stores import CheckpointRecord as CheckpointRecord
from stores import OwnershipScope as OwnershipScope
from stores import StoreUnavailableError as StoreUnavailableError
from stores import compact_json as compact_json
from stores import ms_to_iso as ms_to_iso

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
from ._format import FORMAT as FORMAT
from ._format import NS_META as NS_META
from ._format import ensure_format as ensure_format
from ._journal import FOLLOWING_STATE as FOLLOWING_STATE
from ._journal import NS_BINDING as NS_BINDING
from ._journal import NS_CURSOR as NS_CURSOR
from ._journal import NS_OPERATION as NS_OPERATION
from ._journal import NS_REPLY as NS_REPLY
from ._journal import OPEN_CATEGORY as OPEN_CATEGORY
from ._journal import UNRESOLVED_OPERATION_STATES as UNRESOLVED_OPERATION_STATES
from ._journal import UNRESOLVED_REPLY_STATES as UNRESOLVED_REPLY_STATES
from ._journal import UNSETTLED_REPLY_STATES as UNSETTLED_REPLY_STATES
from ._journal import ChannelJournal as ChannelJournal
from ._journal import Committed as Committed
from ._journal import Loaded as Loaded
from ._journal import Write as Write
from ._journal import binding_actor_prefix as binding_actor_prefix
from ._journal import binding_key as binding_key
from ._journal import categories as categories
from ._journal import category_of as category_of
from ._journal import cursor_key as cursor_key
from ._journal import default_session_id as default_session_id
from ._journal import maybe_answerless as maybe_answerless
from ._journal import notify_operation_id as notify_operation_id
from ._journal import operation_id_for as operation_id_for
from ._journal import operation_key as operation_key
from ._journal import reply_key as reply_key
from ._protocol import OPERATION_FLOW as OPERATION_FLOW
from ._protocol import REPLY_FLOW as REPLY_FLOW
from ._protocol import UNRESOLVED as UNRESOLVED
from ._protocol import Admitted as Admitted
from ._protocol import Change as Change
from ._protocol import Finished as Finished
from ._protocol import OperationRef as OperationRef
from ._protocol import admit as admit
from ._protocol import finish as finish
from ._protocol import mark as mark
from ._protocol import may_move as may_move
from ._protocol import reopen_reply as reopen_reply
from ._protocol import transition as transition
from ._records import BindingRecord as BindingRecord
from ._records import CursorRecord as CursorRecord
from ._records import JournalRecordTooLargeError as JournalRecordTooLargeError
from ._records import OperationInput as OperationInput
from ._records import OperationRecord as OperationRecord
from ._records import ReplyRecord as ReplyRecord
from ._records import StoredButton as StoredButton
from ._records import StoredFile as StoredFile
from ._records import SuspendedRun as SuspendedRun
from ._records import bounded_claims as bounded_claims
