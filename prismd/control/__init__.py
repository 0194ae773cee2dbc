"""The control socket: a Unix socket speaking newline-delimited JSON-RPC 2.0 to operators."""

from ._config import ControlConfig as ControlConfig
from ._config import Operator as Operator
from ._methods import ControlHandler as ControlHandler
from ._methods import pairing_aliases_from_grants as pairing_aliases_from_grants
from ._remote import RemoteTasks as RemoteTasks
from ._server import ControlSocketError as ControlSocketError
from ._server import serve_control as serve_control
from ._server import socket_directory_problem as socket_directory_problem
