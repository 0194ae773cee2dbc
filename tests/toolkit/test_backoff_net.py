"""adapters.toolkit: the one Backoff, and host:port / loopback as the config reads them."""

from __future__ import annotations

import random

import pytest

from adapters.toolkit import Backoff, is_loopback_host, origin_problem, parse_host_port
from prismd.daemon import is_loopback_host as config_is_loopback_host
from prismd.daemon import parse_host_port as config_parse_host_port


def test_delays_double_up_to_the_cap_each_jittered_into_its_upper_half() -> None:
    backoff = Backoff(random.Random(7), base_s=1.0, cap_s=30.0)
    delays = [backoff.next_delay() for _ in range(12)]
    nominal = [min(30.0, 2.0**n) for n in range(12)]
    for delay, bound in zip(delays, nominal):
        assert bound / 2 <= delay <= bound
    assert max(delays) <= 30.0 and delays[-1] >= 15.0
    assert len({round(d, 6) for d in delays}) == len(delays)  # jittered, not a fixed ladder


def test_minimum_and_reset() -> None:
    backoff = Backoff(random.Random(1), base_s=1.0, cap_s=30.0)
    assert backoff.next_delay(minimum=3.0) >= 3.0  # a server's own spacing (Telegram's 409)
    for _ in range(40):  # the count stops growing, the delay stays capped
        assert backoff.next_delay() <= 30.0
    assert backoff.failures == 16
    backoff.reset()
    assert backoff.failures == 0 and backoff.next_delay() <= 1.0


def test_jitter_spreads_receivers_that_failed_together() -> None:
    first = [Backoff(random.Random(seed)).next_delay() for seed in range(50)]
    assert min(first) >= 0.5 and max(first) <= 1.0 and max(first) - min(first) > 0.3


@pytest.mark.parametrize(("base", "cap"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_a_base_outside_the_cap_is_refused(base: float, cap: float) -> None:
    with pytest.raises(ValueError, match="base_s"):
        Backoff(random.Random(), base_s=base, cap_s=cap)


def test_host_port_and_loopback() -> None:
    assert parse_host_port("127.0.0.1:8787") == ("127.0.0.1", 8787)
    assert parse_host_port("[::1]:0") == ("::1", 0)
    for bad, text in [
        ("nohost", "host:port"),
        (":80", "host:port"),
        ("h:x", "host:port"),
        ("::1:80", "brackets"),
        ("[::1:80", "host:port"),
        ("h:70000", "between 0 and 65535"),
    ]:
        with pytest.raises(ValueError, match=text):
            parse_host_port(bad)
    assert all(map(is_loopback_host, ["localhost", "LOCALHOST", "127.9.9.9", "[::1]", "::1"]))
    assert not any(map(is_loopback_host, ["10.0.0.1", "0.0.0.0", "example.com", "[::]", ""]))
    # the config reads addresses with the very same functions
    assert config_parse_host_port is parse_host_port
    assert config_is_loopback_host is is_loopback_host


@pytest.mark.parametrize(
    ("origin", "problem"),
    [
        ("https://api.telegram.org", None),
        ("https://discord.com/", None),
        ("http://127.0.0.1:8081", None),
        ("http://[::1]:8081", None),
        ("http://api.telegram.org", "loopback"),
        ("ftp://example.org", "https://"),
        ("https://example.org/api", "no path"),
        ("https://example.org?x=1", "no path"),
        ("https://user@example.org", "no path"),
        ("example.org", "no path"),
    ],
)
def test_one_origin_rule_for_every_platform(origin: str, problem: str | None) -> None:
    """The Telegram and Discord kinds read ``api_origin`` by this one rule."""
    found = origin_problem(origin, "https://example.org")
    assert (found is None) == (problem is None), found
    if problem is not None:
        assert found is not None and problem in found
