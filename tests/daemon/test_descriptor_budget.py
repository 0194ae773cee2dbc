"""``LimitNOFILE=`` in the unit is sized above the listeners' connection caps, and the
unit's comment that says how states the caps the code has."""

from __future__ import annotations

from adapters.telegram import _webhook
from adapters.webchat import _adapter as webchat
from prismd.control import _server as control
from prismd.daemon import _metrics as metrics
from tests.daemon.test_systemd import UNIT, unit_directives

WEBHOOK = _webhook.MAX_PENDING + _webhook.MAX_SERVING
WEBCHAT = webchat.MAX_PENDING + webchat.MAX_SOCKETS
CONTROL = control.MAX_OPERATOR_CONNECTIONS + control.MAX_REFUSED_CONNECTIONS
HTTP_CLIENT = 100
"""httpx's default pool bound: what one connection's (or agent's) HTTP client may hold."""
SPARE = 1024
"""The store, Python, pipes, epoll: far less than this."""


def test_limit_nofile_covers_ten_connections_with_their_clients() -> None:
    (limit,) = unit_directives()["LimitNOFILE"]
    needed = 10 * max(WEBHOOK, WEBCHAT) + CONTROL + metrics.MAX_CONNECTIONS
    needed += 10 * HTTP_CLIENT + SPARE
    assert int(limit) >= needed
    # what the comment says of systemd's default soft limit
    assert 2 * WEBCHAT + WEBHOOK + CONTROL + metrics.MAX_CONNECTIONS > 1024


def test_the_unit_comment_states_the_caps_of_the_code() -> None:
    text = " ".join(line.lstrip("# ") for line in UNIT.read_text().splitlines())
    for stated in (
        f"a Telegram webhook holds at most {WEBHOOK} connections ({_webhook.MAX_PENDING} "
        f"in a request head + {_webhook.MAX_SERVING} authenticated requests)",
        f"a web chat {WEBCHAT} ({webchat.MAX_PENDING} in their head or before their hello + "
        f"{webchat.MAX_SOCKETS} sockets)",
        f"the control socket {CONTROL} ({control.MAX_OPERATOR_CONNECTIONS} operators + "
        f"{control.MAX_REFUSED_CONNECTIONS} refused being answered)",
        f"/metrics {metrics.MAX_CONNECTIONS}.",
    ):
        assert stated in text, stated
