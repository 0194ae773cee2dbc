"""The web chat's HTTP front: the page, ``/healthz``, and the checks a request passes before
it may become a WebSocket (host, access token, origin).

Routes and access: docs/webchat-protocol.md.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
from collections.abc import Callable, Sequence
from importlib import resources
from urllib.parse import urlsplit

import attrs
import h11
import trio

from ..toolkit import RequestHead as _Head
from ..toolkit import is_loopback_host, parse_host_port, respond

__all__ = ["HttpFront", "parse_listen"]

_PAGE_RESOURCE = "page.html"


def load_page() -> tuple[bytes, str]:
    """The page bytes and its CSP (inline script/style allowed by their SHA-256 only)."""
    html = resources.files("adapters.webchat").joinpath(_PAGE_RESOURCE).read_text(encoding="utf-8")
    script_hashes = [_csp_hash(m) for m in re.findall(r"<script>(.*?)</script>", html, re.S)]
    style_hashes = [_csp_hash(m) for m in re.findall(r"<style>(.*?)</style>", html, re.S)]
    csp = "; ".join(
        [
            "default-src 'none'",
            "script-src " + (" ".join(script_hashes) or "'none'"),
            "style-src " + (" ".join(style_hashes) or "'none'"),
            "connect-src 'self'",
            "img-src 'self' data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )
    return html.encode("utf-8"), csp


def _csp_hash(text: str) -> str:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return "'sha256-" + base64.b64encode(digest).decode("ascii") + "'"


def parse_listen(listen: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` → ``(host, port)``; raises ``ValueError``."""
    host, port = parse_host_port(listen)
    if not host:
        raise ValueError("listen must name a host")
    return host, port


def _host_header_is_loopback(value: str) -> bool:
    """The ``Host`` header names a loopback address (``localhost``, 127/8, ``[::1]``)."""
    try:
        host = urlsplit("//" + value).hostname
    except ValueError:
        return False
    return host is not None and is_loopback_host(host)


MISDIRECTED = (
    b"misdirected request: this web chat answers only to a loopback name"
    b" (http://127.0.0.1:PORT/ or http://localhost:PORT/); from another machine, open an"
    b" SSH tunnel (ssh -L 8787:127.0.0.1:8787 HOST) and browse http://127.0.0.1:8787/\n"
)
"""The 421 body (DNS rebinding protection), for a person who typed the server's name."""


@attrs.define(eq=False)
class HttpFront:
    """Answers every request but an accepted WebSocket upgrade, which :meth:`dispatch` hands
    back to the caller."""

    access_token: str | None
    listener_state: Callable[[], str]
    """``listening`` or ``stopped``, for ``/healthz``."""
    on_loopback: bool = True
    """The listener's address is a loopback one (set once it is known)."""
    _page: bytes = attrs.field(init=False)
    _csp: str = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._page, self._csp = load_page()

    async def dispatch(self, stream: trio.SocketStream, conn: h11.Connection, head: _Head) -> bool:
        """Answer one request; True when it is a WebSocket upgrade that passed every check
        (unanswered: the caller accepts it)."""
        if not self._host_allowed(head):
            await self._respond(stream, conn, head.method, 421, MISDIRECTED)
            return False
        if head.path == "/healthz":
            if head.method not in ("GET", "HEAD"):
                await self._respond(stream, conn, head.method, 405, b"method not allowed\n")
                return False
            body = json.dumps({"status": "ok", "listener": self.listener_state()}).encode() + b"\n"
            await self._respond(stream, conn, head.method, 200, body, "application/json")
            return False
        if head.path not in ("/", "/ws"):
            await self._respond(stream, conn, head.method, 404, b"not found\n")
            return False
        if head.method not in ("GET", "HEAD"):
            await self._respond(stream, conn, head.method, 405, b"method not allowed\n")
            return False
        credentials = self._credentials(head)
        if self.access_token and len(credentials) > 1:
            # One guess per request: never compare several presented tokens.
            await self._respond(stream, conn, head.method, 400, b"one access token at most\n")
            return False
        if not self._authorized(credentials):
            await self._respond(
                stream,
                conn,
                head.method,
                401,
                b"unauthorized\n",
                extra=[("WWW-Authenticate", "Bearer")],
            )
            return False
        if head.path == "/":
            await self._respond(
                stream,
                conn,
                head.method,
                200,
                self._page,
                "text/html; charset=utf-8",
                extra=[
                    ("Content-Security-Policy", self._csp),
                    ("X-Frame-Options", "DENY"),
                ],
            )
            return False
        upgrade = head.headers.get("upgrade", "").lower() == "websocket"
        connection_tokens = {
            t.strip().lower() for t in head.headers.get("connection", "").split(",")
        }
        if head.method != "GET" or not upgrade or "upgrade" not in connection_tokens:
            await self._respond(
                stream,
                conn,
                head.method,
                426,
                b"websocket upgrade required\n",
                extra=[("Upgrade", "websocket")],
            )
            return False
        if not self._origin_allowed(head):
            await self._respond(stream, conn, head.method, 403, b"forbidden origin\n")
            return False
        return True

    def _host_allowed(self, head: _Head) -> bool:
        # On loopback without a token, being local is the only protection: a page on another
        # site that rebinds its DNS name to 127.0.0.1 would otherwise reach us with its own
        # Host. A token (or pairing off loopback) protects the other cases. An absolute-form
        # target's authority is the request's host for HTTP (RFC 9112 §3.2.2), so it must
        # pass the same test; the Host header must too, whatever a proxy makes of the two.
        if self.access_token or not self.on_loopback:
            return True
        if head.authority is not None and not _host_header_is_loopback(head.authority):
            return False
        return _host_header_is_loopback(head.headers.get("host", ""))

    def _origin_allowed(self, head: _Head) -> bool:
        # Browsers always send Origin on a WebSocket; other sites must not drive the chat.
        origin = head.headers.get("origin")
        if origin is None:
            return True  # non-browser clients (prismctl chat)
        try:
            parts = urlsplit(origin)
        except ValueError:
            return False
        host = head.authority if head.authority is not None else head.headers.get("host", "")
        return parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower()

    @staticmethod
    def _credentials(head: _Head) -> list[str]:
        """Every access token the request presents (a bearer header, ``token=`` params)."""
        auth = head.headers.get("authorization", "")
        presented: list[str] = []
        if auth[:7].lower() == "bearer ":
            presented.append(auth[7:].strip())
        presented.extend(head.query.get("token", []))
        return presented

    def _authorized(self, credentials: Sequence[str]) -> bool:
        """The one presented token (at most one, see :meth:`_credentials`) is ours."""
        if not self.access_token:
            return True
        return len(credentials) == 1 and hmac.compare_digest(
            credentials[0].encode("utf-8"), self.access_token.encode("utf-8")
        )

    _respond = staticmethod(respond)
    """The shared responder (:func:`adapters.toolkit.respond`)."""
