"""TLS for loopback test servers: a throwaway certificate authority (trustme) that the
default SSL context of the code under test trusts, and server contexts for ``localhost``.

Everything is written under the test's own directory (trustme's ``configure_cert`` would
write into the temporary directory, which tests/conftest.py's audit hook refuses when the
clone itself sits there)."""

from __future__ import annotations

import itertools
import ssl
from pathlib import Path

import pytest
import trustme

_names = itertools.count()


def trust(ca: trustme.CA, directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``ca`` the whole trust store of ``ssl.create_default_context()`` for the test."""
    path = directory / f"ca-{next(_names)}.pem"
    ca.cert_pem.write_to_path(str(path))
    monkeypatch.setenv("SSL_CERT_FILE", str(path))


def server_context(ca: trustme.CA, directory: Path) -> ssl.SSLContext:
    """A server context whose certificate for ``localhost`` ``ca`` issued."""
    path = directory / f"localhost-{next(_names)}.pem"
    ca.issue_cert("localhost").private_key_and_cert_chain_pem.write_to_path(str(path))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(path))
    return context
