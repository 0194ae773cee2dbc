"""``check-config`` for the a2a agent kind, ``[a2a]`` and ``max_remote_tasks_per_tenant``:
a good config loads, each bad one is refused naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from prismd.daemon import load_config

from .test_config import error_of, write

GOOD = """
[a2a]
push_listen = "127.0.0.1:8790"
push_base_url = "https://bot.example.org/"

[limits]
max_remote_tasks_per_tenant = 50

[agents.researcher]
kind = "a2a"
url = "https://agents.example.org/research/"
bearer_token_env = "RESEARCHER_TOKEN"
protocol = "auto"
push = true
stream = true
poll_interval_ms = 2000
max_poll_interval_ms = 60000
task_timeout_ms = 3600000

[[connections]]
id = "web"
kind = "webchat"
listen = "127.0.0.1:8787"

[[grants]]
connection = "web"
actors = ["*"]
aliases = ["researcher"]
"""


def test_a_complete_a2a_config_loads(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD), env={})
    assert config.a2a is not None
    assert config.a2a.push_url("researcher") == "https://bot.example.org/a2a/push/researcher"
    assert config.limits.max_remote_tasks_per_tenant == 50
    agent = config.agents["researcher"]
    assert agent.kind == "a2a" and agent.options["protocol"] == "auto"


def test_push_base_url_defaults_to_the_listen_address(tmp_path: Path) -> None:
    text = '[a2a]\npush_listen = "127.0.0.1:8790"\n'
    config = load_config(write(tmp_path, text), env={})
    assert config.a2a is not None
    assert config.a2a.push_url("x") == "http://127.0.0.1:8790/a2a/push/x"
    assert load_config(write(tmp_path, "", "empty.toml"), env={}).a2a is None


AGENT = '[agents.r]\nkind = "a2a"\n'


@pytest.mark.parametrize(
    ("body", "key", "fragment"),
    [
        (AGENT, "[agents.r].url", "url or card_url"),
        (AGENT + 'url = "http://agents.example.org/"\n', "[agents.r].url", "loopback"),
        (
            AGENT + 'url = "https://a.example/"\ncard_url = "https://a.example/c.json"\n',
            "[agents.r].url",
            "exactly one",
        ),
        (AGENT + 'card_url = "ftp://a.example/c.json"\n', "[agents.r].card_url", "http"),
        (AGENT + 'url = "https://a.example/"\nprotocol = "2.0"\n', "[agents.r].protocol", "auto"),
        (AGENT + 'url = "https://a.example/"\npush = "yes"\n', "[agents.r].push", "true or"),
        (
            AGENT + 'url = "https://a.example/"\npoll_interval_ms = 0\n',
            "[agents.r].poll_interval_ms",
            "integer",
        ),
        (
            AGENT
            + 'url = "https://a.example/"\npoll_interval_ms = 5000\nmax_poll_interval_ms = 100\n',
            "[agents.r].max_poll_interval_ms",
            "at least",
        ),
        (
            AGENT
            + 'url = "https://a.example/"\nbearer_token_env = "A"\nbearer_token_file = "/f"\n',
            "[agents.r].bearer_token_file",
            "not both",
        ),
        (AGENT + 'url = "https://a.example/"\nbearer_token = "x"\n', "[agents.r].bearer_token", ""),
        (AGENT + 'url = "https://a.example/"\nsurprise = 1\n', "[agents.r].surprise", "unknown"),
        ('[a2a]\npush_listen = "0.0.0.0:8790"\n', "[a2a].push_listen", "push_base_url"),
        ('[a2a]\npush_listen = "nope"\n', "[a2a].push_listen", ""),
        (
            '[a2a]\npush_listen = "127.0.0.1:1"\npush_base_url = "http://bot.example.org"\n',
            "[a2a].push_base_url",
            "loopback",
        ),
        ('[a2a]\npush_listen = "127.0.0.1:1"\nextra = 1\n', "[a2a].extra", "unknown"),
        ("[limits]\nmax_remote_tasks_per_tenant = 0\n", "[limits].max_remote_tasks_per_tenant", ""),
    ],
)
def test_bad_a2a_configs_name_the_key(tmp_path: Path, body: str, key: str, fragment: str) -> None:
    error = error_of(tmp_path, body)
    assert error.key == key, str(error)
    assert fragment in error.message


def test_check_runnable_needs_the_bearer_token(tmp_path: Path) -> None:
    from prismd.daemon import check_runnable
    from prismd.daemon._config import ConfigError

    config = load_config(write(tmp_path, GOOD), env={})
    with pytest.raises(ConfigError) as missing:
        check_runnable(config, env={})
    assert missing.value.key == "[agents.researcher].bearer_token_env"
    assert "SECRET-TOKEN" not in str(missing.value)
    check_runnable(config, env={"RESEARCHER_TOKEN": "SECRET-TOKEN"})
