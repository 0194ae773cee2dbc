"""What the adapters share, so each platform adapter holds only its platform:

* HTTP/1.1 — :class:`Http11`, the one client of the Bot APIs (keep-alive, one
  write per request, bounded reads, failures named by cause: :class:`HttpTransportError`);
  one bounded request-head reader (408 slow head, 431 oversized head,
  400), body reader (413, 408) and responder, :func:`serve_requests`, the keep-alive loop
  of a receiver of POSTs, in the budgets of :func:`receiver_limiter`, and
  :func:`close_gracefully` so an error answer reaches a client that is still sending;
* what every receiver needs (:mod:`._receiver`): :class:`ReceiverLease` — the receiver
  lease: acquire (taking over our own predecessor's at once), renew at half the TTL, fail
  closed, report loss (to a :class:`LeaseWatch`, which wakes who waits for it);
  :class:`Backoff`, the one bounded exponential backoff with jitter;
  :class:`Interrupts`, waits that one call cuts short (a lost lease, a stop);
  :class:`Activity`, what a receiving adapter last saw, for ``health()``;
* JSON-RPC 2.0 — :func:`open_jsonrpc_client`, a Trio client with per-call deadlines and
  bounded pending calls over the newline-delimited framing of :mod:`prismd.jsonrpc`
  (re-exported here);
* :func:`serve_limited` with a :class:`ConnectionLimiter` — the one accept loop of every
  listener (TCP ones opened and closed by :func:`open_listeners`): connections split into
  budgets (a flood of one kind cannot take the places of another), a full budget evicts its
  idlest member or refuses, out-of-descriptor accept errors back off and log once per
  interval; :class:`LogThrottle` for such lines;
* :class:`AdapterDefaults`, what an adapter answers for the features it does not offer;
* :func:`parse_host_port` and :func:`is_loopback_host`, which the config uses too, and the
  connection keys several kinds read alike (:class:`TokenConnection`, :func:`api_origin`,
  :func:`typing_delay_ms`);
* re-exported from :mod:`prismd.channel`: :func:`chunk_text` and :func:`utf16_units`,
  message limits in UTF-16 code units (beside the UTF-8 measures of the journal), and
  :func:`button_lines`, approval buttons as text for a channel without buttons (beside
  :class:`~prismd.channel.Button`).
"""

from prismd.channel import button_lines as button_lines
from prismd.channel import chunk_text as chunk_text
from prismd.channel import utf16_units as utf16_units
from prismd.jsonrpc import FrameTooLargeError as FrameTooLargeError
from prismd.jsonrpc import Incoming as Incoming
from prismd.jsonrpc import RpcError as RpcError

from ._budgets import Budget as Budget
from ._budgets import BudgetStatistics as BudgetStatistics
from ._budgets import ConnectionLimiter as ConnectionLimiter
from ._budgets import Slot as Slot
from ._budgets import open_listeners as open_listeners
from ._budgets import serve_limited as serve_limited
from ._config import TokenConnection as TokenConnection
from ._config import api_origin as api_origin
from ._config import bounded_field as bounded_field
from ._config import check_connection_id as check_connection_id
from ._config import token_keys as token_keys
from ._config import typing_delay_ms as typing_delay_ms
from ._defaults import AdapterDefaults as AdapterDefaults
from ._http import PENDING as PENDING
from ._http import SERVING as SERVING
from ._http import HttpError as HttpError
from ._http import RequestHead as RequestHead
from ._http import read_body as read_body
from ._http import read_request_head as read_request_head
from ._http import receiver_limiter as receiver_limiter
from ._http import respond as respond
from ._http import serve_requests as serve_requests
from ._http import server_connection as server_connection
from ._http_client import Header as Header
from ._http_client import Http11 as Http11
from ._http_client import HttpTransportError as HttpTransportError
from ._http_client import Origin as Origin
from ._http_client import ReadTimeout as ReadTimeout
from ._http_client import ResponseTooLarge as ResponseTooLarge
from ._jsonrpc import JsonRpcClient as JsonRpcClient
from ._jsonrpc import JsonRpcConnectionError as JsonRpcConnectionError
from ._jsonrpc import JsonRpcTimeoutError as JsonRpcTimeoutError
from ._jsonrpc import open_jsonrpc_client as open_jsonrpc_client
from ._net import is_loopback_host as is_loopback_host
from ._net import origin_problem as origin_problem
from ._net import parse_host_port as parse_host_port
from ._receiver import ACTIVITY_FIELDS as ACTIVITY_FIELDS
from ._receiver import Activity as Activity
from ._receiver import Backoff as Backoff
from ._receiver import Interrupts as Interrupts
from ._receiver import LeaseLostError as LeaseLostError
from ._receiver import LeaseWatch as LeaseWatch
from ._receiver import ReceiverLease as ReceiverLease
from ._receiver import connection_service_scope as connection_service_scope
from ._streams import close_gracefully as close_gracefully
from ._throttle import LOG_INTERVAL_S as LOG_INTERVAL_S
from ._throttle import LogThrottle as LogThrottle
from ._throttle import quiet_note as quiet_note
