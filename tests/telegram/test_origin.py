"""``api_origin`` accepts exactly what ``check-config`` accepts (one loopback rule)."""

from __future__ import annotations

import pytest

from adapters.telegram._api import validate_api_origin
from adapters.toolkit import is_loopback_host


@pytest.mark.parametrize(
    "origin",
    ["https://api.telegram.org", "http://127.0.0.1:8081", "http://127.0.0.2:9", "http://[::1]:80"],
)
def test_origins_config_accepts_are_accepted(origin: str) -> None:
    assert validate_api_origin(origin) == origin


@pytest.mark.parametrize(
    "origin", ["http://api.telegram.org", "http://10.0.0.1", "https://h/path", "ftp://h"]
)
def test_other_origins_are_refused(origin: str) -> None:
    with pytest.raises(ValueError, match="https origin"):
        validate_api_origin(origin)


def test_the_rule_is_configs() -> None:
    assert is_loopback_host("127.0.0.2") and not is_loopback_host("10.0.0.1")
