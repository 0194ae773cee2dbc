"""What the adapters share: one HTTP/1.1 request-head reader and responder over h11
(408 for a slow head, 431 for an oversized one, 413, bounded reads)."""

from ._http import HttpError as HttpError
from ._http import RequestHead as RequestHead
from ._http import read_body as read_body
from ._http import read_request_head as read_request_head
from ._http import respond as respond
from ._http import server_connection as server_connection
