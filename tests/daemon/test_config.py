"""prismd.daemon._config: the TOML loader, its errors, defaults and secrets."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from prismd.control import ControlConfig, Operator
from prismd.daemon._config import (
    AgentConfig,
    ConfigError,
    GrantConfig,
    SignalConnectionConfig,
    TelegramConnectionConfig,
    WebchatConnectionConfig,
    default_config,
    is_loopback_host,
    load_config,
    parse_config,
    parse_host_port,
    read_secret,
)
from prismd.limits import Limits

FULL = """
[daemon]
state_dir = "/var/lib/prismd"

[store]
url = "sqlite:////var/lib/prismd/journal.sqlite"

[limits]
stop_deadline_ms = 20000
max_routes = 50

[control]
socket = "/run/prismd/control.sock"
group = "prismd-operators"
max_request_bytes = 4096
idle_timeout_ms = 5000

[[control.operators]]
uid = 1000
tenant = "acme"
user = "alice"

[[control.operators]]
uid = 1001
tenant = "acme"
account = "tg-main"

[[connections]]
id = "tg-main"
kind = "telegram"
token_file = "telegram-token"
mode = "webhook"
webhook_listen = "127.0.0.1:9443"
webhook_secret_env = "TG_WEBHOOK_SECRET"
allow_groups = true
poll_timeout_s = 10

[[connections]]
id = "sig"
kind = "signal"
account = "+15550001111"
tcp = "127.0.0.1:7583"

[[connections]]
id = "web"
kind = "webchat"
listen = "0.0.0.0:8787"
access_token_env = "WEBCHAT_TOKEN"

[[grants]]
connection = "tg-main"
actors = ["202", "303"]
tenant = "acme"
aliases = ["echo", "slow"]
default_alias = "slow"
notifications = true

[[grants]]
connection = "web"
actors = ["*"]
aliases = ["echo"]

[[grants]]
connection = "sig"
pairing = true
aliases = ["echo"]
account = "signal-acct"

[agents.echo]
kind = "echo"

[agents.slow]
kind = "mock"
delay_ms = 1500
fail = false
"""


def write(tmp_path: Path, text: str, name: str = "prismd.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(tmp_path: Path, text: str) -> ConfigError:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.file == str(path)
    assert str(info.value).startswith(f"{path}: ")
    return info.value


MINIMAL_WEB = """
[[connections]]
id = "web"
kind = "webchat"

[agents.echo]
kind = "echo"
"""


def test_full_valid_file(tmp_path: Path) -> None:
    path = write(tmp_path, FULL)
    config = load_config(path, env={})
    assert config.source == str(path)
    assert config.daemon.state_dir == "/var/lib/prismd"
    assert config.store.url == "sqlite:////var/lib/prismd/journal.sqlite"
    assert config.limits == Limits(stop_deadline_ms=20000, max_routes=50)
    assert config.control == ControlConfig(
        socket="/run/prismd/control.sock",
        group="prismd-operators",
        operators=(
            Operator(uid=1000, tenant="acme", user="alice"),
            Operator(uid=1001, tenant="acme", account="tg-main"),
        ),
        max_request_bytes=4096,
        idle_timeout_ms=5000,
    )
    tg, sig, web = config.connections
    assert tg == TelegramConnectionConfig(
        id="tg-main",
        token_file="telegram-token",
        mode="webhook",
        webhook_listen="127.0.0.1:9443",
        webhook_secret_env="TG_WEBHOOK_SECRET",
        allow_groups=True,
        poll_timeout_s=10,
    )
    assert tg.kind == "telegram"
    assert tg.effective_webhook_path == "/telegram/tg-main"
    assert sig == SignalConnectionConfig(id="sig", account="+15550001111", tcp="127.0.0.1:7583")
    assert web == WebchatConnectionConfig(
        id="web", listen="0.0.0.0:8787", access_token_env="WEBCHAT_TOKEN"
    )
    assert config.grants[0] == GrantConfig(
        connection="tg-main",
        actors=("202", "303"),
        tenant="acme",
        aliases=("echo", "slow"),
        default_alias="slow",
        notifications=True,
    )
    assert config.grants[1].actors == ("*",)
    assert config.grants[2].pairing is True
    assert config.grants[2].account == "signal-acct"
    assert config.grants[2].actors == ()
    assert set(config.agents) == {"echo", "slow"}
    assert config.agents["slow"].kind == "mock"
    assert dict(config.agents["slow"].options) == {"delay_ms": 1500, "fail": False}
    assert config.connection("sig") is sig
    assert config.connection("nope") is None


def test_postgres_store_settings(tmp_path: Path) -> None:
    path = tmp_path / "prismd.toml"
    path.write_text(
        "[store]\nurl = 'postgresql://prismd@db:5432/prismd?schema=team'\n"
        "pool_size = 6\npassword_file = 'pg-password'\nstatement_timeout_ms = 2500\n"
    )
    store = load_config(path).store
    assert (store.is_postgres, store.pool_size, store.statement_timeout_ms) == (True, 6, 2500)
    (tmp_path / "pg-password").write_text("s3cret-7f3a\n")
    options = store.postgres_options(env={"CREDENTIALS_DIRECTORY": str(tmp_path)})
    assert options is not None and options.password == "s3cret-7f3a"
    assert (options.pool_size, options.connect_timeout_ms) == (6, 5000)
    assert "s3cret-7f3a" not in repr(options)
    with pytest.raises(ConfigError) as info:
        store.postgres_options(env={})
    assert info.value.key == "[store].password_file"
    assert load_config(None).store.postgres_options() is None  # SQLite: no pool settings


def test_empty_file_is_valid_and_takes_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, ""), env={})
    assert config.connections == ()
    assert config.limits == Limits()
    assert config.control == ControlConfig()


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        ("bogus = 1\n", "bogus", "unknown key"),
        ("[store]\nurl = 'sqlite:///x'\npath = 'y'\n", "[store].path", "unknown key"),
        ("[daemon]\nstate = 'x'\n", "[daemon].state", "unknown key"),
        ("[store]\nurl = 3\n", "[store].url", "must be a string, got integer"),
        ("[store]\nurl = 'mysql://x'\n", "[store].url", "sqlite:///PATH"),
        ("[store]\nurl = 'sqlite:///x'\npool_size = 4\n", "[store].pool_size", "postgresql://"),
        (
            "[store]\nurl = 'postgresql://u:SECRET@h/d'\n",
            "[store].url",
            "a password in the URL is a secret inline",
        ),
        ("[store]\nurl = 'postgres://u@h/d'\npool_size = 1\n", "[store].pool_size", "between 2"),
        (
            "[store]\nurl = 'postgres://u@h/d'\npassword_env = 'A'\npassword_file = 'b'\n",
            "[store].password_env",
            "not both",
        ),
        ("[store]\nurl = 'postgres://u@h/d'\npassword = 'SECRET'\n", "[store].password", "inline"),
        ("[store]\nurl = 'postgres://u@h/d'\nschema = 'x'\n", "[store].schema", "unknown key"),
        ("[limits]\nmax_routes = 0\n", "[limits].max_routes", "between 1 and 10000"),
        ("[limits]\nmax_routes = 20000\n", "[limits].max_routes", "between 1 and 10000"),
        ("[limits]\nmax_routes = 'ten'\n", "[limits].max_routes", "must be a number"),
        ("[limits]\nmax_routes = true\n", "[limits].max_routes", "must be a number"),
        ("[limits]\nmax_rooms = 3\n", "[limits].max_rooms", "unknown key"),
        ("[control]\nmax_request_bytes = 10\n", "[control].max_request_bytes", "between"),
        ("[control]\nsocket = ''\n", "[control].socket", "must not be empty"),
        ("[control]\nidle_timeout_ms = 1.5\n", "[control].idle_timeout_ms", "got float"),
        ("[[control.operators]]\ntenant = 'a'\n", "[control].operators[1].uid", "required"),
        (
            "[[control.operators]]\nuid = 5\n[[control.operators]]\nuid = 5\n",
            "[control].operators[2].uid",
            "listed twice",
        ),
        ("[[control.operators]]\nuid = -1\n", "[control].operators[1].uid", "between"),
        ("[[control.operators]]\nuid = 1\nrole = 'x'\n", "[control].operators[1].role", "unknown"),
        ("connections = 3\n", "connections", "array of tables"),
        ("[agents]\necho = 3\n", "[agents.echo]", "must be a table"),
        ("[agents.echo]\nkind = 'gpt'\n", "[agents.echo].kind", "'echo', 'mock', 'openai'"),
        ("[agents.echo]\n", "[agents.echo].kind", "is required"),
        ("[agents.x]\nkind = 'mock'\ndelay_ms = 'slow'\n", "[agents.x]", "delay_ms"),
        ("[agents.x]\nkind = 'mock'\napi_key = 'sk-SECRET'\n", "[agents.x].api_key", "inline"),
        ("[agents.x]\nkind = 'echo'\nspeed = 1\n", "[agents.x].speed", "unknown"),
        ("[agents.x]\nkind = 'python'\n", "[agents.x].factory", "required"),
        ("[agents.'bad alias']\nkind = 'echo'\n", "[agents.bad alias]", "alias"),
        ("token = 'SECRET'\n", "token", "never inline"),
    ],
)
def test_errors_name_file_and_key(tmp_path: Path, text: str, key: str, fragment: str) -> None:
    error = error_of(tmp_path, text)
    assert error.key is not None
    assert error.key.startswith(key), str(error)
    assert fragment in str(error)
    assert "SECRET" not in str(error)


CONNECTION_ERRORS = [
    (
        "id = 'a'\nkind = 'irc'",
        "[[connections]][2].kind",
        "'telegram', 'signal', 'webchat' or 'discord'",
    ),
    ("kind = 'webchat'", "[[connections]][2].id", "required"),
    ("id = 'web'\nkind = 'webchat'", "[[connections]][2].id", "duplicate connection id 'web'"),
    ("id = 'a b'\nkind = 'webchat'", "[[connections]][2].id", "letters"),
    ("id = 't'\nkind = 'telegram'", "[[connections]][2].token_env", "exactly one"),
    (
        "id = 't'\nkind = 'telegram'\ntoken_env = 'A'\ntoken_file = 'f'",
        "[[connections]][2].token_env",
        "exactly one",
    ),
    (
        "id = 't'\nkind = 'telegram'\ntoken = '123456:SECRET'",
        "[[connections]][2].token",
        "use token_env or token_file",
    ),
    ("id = 't'\nkind = 'telegram'\ntoken_env = 'A'\nmode = 'push'", ".mode", "'polling' or"),
    (
        "id = 't'\nkind = 'telegram'\ntoken_env = 'A'\nmode = 'webhook'",
        ".webhook_secret_env",
        "required in webhook mode",
    ),
    (
        "id = 't'\nkind = 'telegram'\ntoken_env = 'A'\napi_origin = 'http://example.com'",
        "[[connections]][2].api_origin",
        "only for loopback",
    ),
    (
        "id = 't'\nkind = 'telegram'\ntoken_env = 'A'\napi_origin = 'ftp://127.0.0.1'",
        "[[connections]][2].api_origin",
        "https://",
    ),
    (
        "id = 't'\nkind = 'telegram'\ntoken_env = 'A'\napi_origin = 'https://x.org/bot1'",
        "[[connections]][2].api_origin",
        "origin",
    ),
    ("id = 't'\nkind = 'telegram'\ntoken_env = 'A'\nlisten = '1:2'", ".listen", "unknown key"),
    ("id = 't'\nkind = 'telegram'\ntoken_env = 'A'\npoll_timeout_s = 99", ".poll_timeout_s", "50"),
    ("id = 't'\nkind = 'telegram'\ntoken_env = 'A'\nallow_groups = 1", ".allow_groups", "true or"),
    ("id = 't'\nkind = 'telegram'\ntoken_env = 'A'\nwebhook_path = 'x'", ".webhook_path", "'/'"),
    ("id = 't'\nkind = 'telegram'\ntoken_env = 'A B'", ".token_env", "environment variable"),
    ("id = 's'\nkind = 'signal'\ntcp = '127.0.0.1:1'", ".account", "required"),
    ("id = 's'\nkind = 'signal'\naccount = '+1'", ".socket", "exactly one of socket and tcp"),
    ("id = 's'\nkind = 'signal'\naccount = '+1'\ntcp = 'nohost'", ".tcp", "host:port"),
    (
        "id = 's'\nkind = 'signal'\naccount = '+1'\ntcp = 'localhost:1'\nmode = 'x'",
        ".mode",
        "unknown",
    ),
    ("id = 'w'\nkind = 'webchat'\nlisten = '::1:80'", ".listen", "brackets"),
    ("id = 'w'\nkind = 'webchat'\nlisten = '0.0.0.0:8788'", ".listen", "access_token_env"),
    ("id = 'w'\nkind = 'webchat'\ntoken_env = 'X'", ".token_env", "unknown key"),
]


@pytest.mark.parametrize(("body", "key", "fragment"), CONNECTION_ERRORS)
def test_connection_errors(tmp_path: Path, body: str, key: str, fragment: str) -> None:
    error = error_of(tmp_path, MINIMAL_WEB + "\n[[connections]]\n" + body + "\n")
    assert error.key is not None
    assert key in error.key, str(error)
    assert fragment in str(error)
    assert "SECRET" not in str(error)


GRANT_ERRORS = [
    ("connection = 'nope'\nactors = ['*']\naliases = ['echo']", ".connection", "'nope'"),
    ("actors = ['*']\naliases = ['echo']", ".connection", "required"),
    ("connection = 'web'\naliases = ['echo']", "[[grants]][1].actors", "pairing = true"),
    ("connection = 'web'\nactors = []\naliases = ['echo']", ".actors", "pairing = true"),
    ("connection = 'web'\nactors = ['*', '1']\naliases = ['echo']", ".actors", "only entry"),
    ("connection = 'web'\nactors = [1, 2]\naliases = ['echo']", ".actors", "array of non-empty"),
    ("connection = 'web'\nactors = '*'\naliases = ['echo']", ".actors", "got string"),
    ("connection = 'web'\nactors = ['*']", ".aliases", "at least one"),
    ("connection = 'web'\nactors = ['*']\naliases = ['gpt']", ".aliases", "'gpt' is not an agent"),
    (
        "connection = 'web'\nactors = ['*']\naliases = ['echo']\ndefault_alias = 'x'",
        ".default_alias",
        "not one of aliases",
    ),
    ("connection = 'web'\npairing = 'yes'\naliases = ['echo']", ".pairing", "true or false"),
    ("connection = 'web'\nactors = ['*']\naliases = ['echo']\nrole = 1", ".role", "unknown key"),
]


@pytest.mark.parametrize(("body", "key", "fragment"), GRANT_ERRORS)
def test_grant_errors(tmp_path: Path, body: str, key: str, fragment: str) -> None:
    error = error_of(tmp_path, MINIMAL_WEB + "\n[[grants]]\n" + body + "\n")
    assert error.key is not None
    assert key in error.key, str(error)
    assert error.key.startswith("[[grants]][1]")
    assert fragment in str(error)


def test_non_loopback_webchat_accepted_with_pairing_grant(tmp_path: Path) -> None:
    text = """
    [[connections]]
    id = "w"
    kind = "webchat"
    listen = "192.0.2.1:8787"

    [[grants]]
    connection = "w"
    pairing = true
    aliases = ["echo"]

    [agents.echo]
    kind = "echo"
    """
    config = load_config(write(tmp_path, text), env={})
    assert config.connections[0].kind == "webchat"


def test_non_loopback_webchat_refuses_a_wildcard_grant_without_token(tmp_path: Path) -> None:
    """A pairing grant does not make an exposed web chat safe when another grant lets
    every actor in: anyone reaching the port would talk to the agent."""
    text = """
    [[connections]]
    id = "w"
    kind = "webchat"
    listen = "192.0.2.1:8787"

    [[grants]]
    connection = "w"
    pairing = true
    aliases = ["echo"]

    [[grants]]
    connection = "w"
    actors = ["*"]
    aliases = ["echo"]

    [agents.echo]
    kind = "echo"
    """
    with pytest.raises(ConfigError, match="actors") as info:
        load_config(write(tmp_path, text), env={})
    assert info.value.key == "[[connections]][1].listen"


def test_http_origin_allowed_for_loopback_hosts(tmp_path: Path) -> None:
    for origin in (
        "http://127.0.0.1:8081",
        "http://localhost:9",
        "http://[::1]:80",
        "http://127.9.9.9",
    ):
        text = "[[connections]]\nid = 't'\nkind = 'telegram'\ntoken_env = 'T'\n"
        text += f"api_origin = '{origin}'\n"
        config = load_config(write(tmp_path, text), env={})
        conn = config.connections[0]
        assert isinstance(conn, TelegramConnectionConfig)
        assert conn.api_origin == origin


def test_file_level_errors(tmp_path: Path) -> None:
    missing = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match="file not found") as info:
        load_config(missing, env={})
    assert info.value.file == str(missing)
    error = error_of(tmp_path, "[store\nurl = 1\n")
    assert "invalid TOML" in str(error)
    assert error.key is None
    path = tmp_path / "bin.toml"
    path.write_bytes(b"a = '\xff'\n")
    with pytest.raises(ConfigError, match="UTF-8"):
        load_config(path, env={})


def test_none_path_uses_local_file_or_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert load_config(None, env={}) == default_config({})
    (tmp_path / "prismd.toml").write_text("[daemon]\nstate_dir = 'elsewhere'\n")
    config = load_config(None, env={})
    assert config.source == "prismd.toml"
    assert config.daemon.state_dir == "elsewhere"


def test_default_config_without_telegram() -> None:
    config = default_config({})
    assert config.source is None
    assert config.store.url == "sqlite:///var/journal.sqlite"
    assert config.control.socket == "var/run/control.sock"
    assert config.daemon.state_dir == "var"
    assert config.connections == (WebchatConnectionConfig(id="web"),)
    assert config.connections[0].listen == "127.0.0.1:8787"
    assert config.grants == (GrantConfig(connection="web", actors=("*",), aliases=("echo",)),)
    assert dict(config.agents) == {"echo": AgentConfig(alias="echo", kind="echo")}
    assert config.limits == Limits()


def test_default_config_with_telegram() -> None:
    config = default_config({"TELEGRAM_BOT_TOKEN": "123456:" + "A" * 35})
    ids = [c.id for c in config.connections]
    assert ids == ["web", "telegram"]
    telegram = config.connections[1]
    assert isinstance(telegram, TelegramConnectionConfig)
    assert telegram.token_env == "TELEGRAM_BOT_TOKEN"
    assert telegram.mode == "polling"
    assert "AAAA" not in repr(config)
    grant = config.grants[1]
    assert grant.connection == "telegram"
    assert grant.pairing is True
    assert grant.actors == ()
    assert grant.aliases == ("echo",)
    # An empty variable is "not set".
    assert len(default_config({"TELEGRAM_BOT_TOKEN": " "}).connections) == 1


def test_operator_for() -> None:
    control = ControlConfig(operators=(Operator(uid=7, tenant="acme"),))
    assert control.operator_for(7) == Operator(uid=7, tenant="acme")
    assert control.operator_for(8) is None
    assert control.operator_for(8, daemon_uid=8) == Operator(uid=8, tenant="default")
    assert control.operator_for(7, daemon_uid=7) == Operator(uid=7, tenant="acme")


def test_read_secret_from_env() -> None:
    assert read_secret(env_name="TOK", file_name=None, env={"TOK": " s3cret\n"}) == "s3cret"
    with pytest.raises(ConfigError) as info:
        read_secret(env_name="TOK", file_name=None, env={}, key="[[connections]][1].token_env")
    assert info.value.key == "[[connections]][1].token_env"
    assert "TOK" in str(info.value)
    with pytest.raises(ConfigError, match="not set or empty"):
        read_secret(env_name="TOK", file_name=None, env={"TOK": ""})


def test_read_secret_from_file(tmp_path: Path) -> None:
    secret = tmp_path / "tok"
    secret.write_text("file-secret\n")
    assert read_secret(env_name=None, file_name=str(secret), env={}) == "file-secret"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty") as info:
        read_secret(env_name=None, file_name=str(tmp_path / "empty"), env={})
    assert info.value.key == "token_file"
    with pytest.raises(ConfigError, match="not found"):
        read_secret(env_name=None, file_name=str(tmp_path / "nope"), env={})
    with pytest.raises(ConfigError, match="token_env or token_file"):
        read_secret(env_name=None, file_name=None, env={})


def test_read_secret_prefers_credentials_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "telegram-token").write_text("from-credentials\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "telegram-token").write_text("from-cwd\n")
    monkeypatch.chdir(cwd)
    env = {"CREDENTIALS_DIRECTORY": str(creds)}
    assert read_secret(env_name=None, file_name="telegram-token", env=env) == "from-credentials"
    # Without the credentials directory (or the file in it) the relative path is used.
    assert read_secret(env_name=None, file_name="telegram-token", env={}) == "from-cwd"
    (creds / "telegram-token").unlink()
    assert read_secret(env_name=None, file_name="telegram-token", env=env) == "from-cwd"


def test_address_helpers() -> None:
    assert parse_host_port("127.0.0.1:8787") == ("127.0.0.1", 8787)
    assert parse_host_port("[::1]:80") == ("::1", 80)
    for bad in ("nope", ":80", "h:x", "h:70000", "::1:80"):
        with pytest.raises(ValueError):
            parse_host_port(bad)
    assert is_loopback_host("localhost")
    assert is_loopback_host("127.3.2.1")
    assert is_loopback_host("[::1]")
    assert not is_loopback_host("10.0.0.1")
    assert not is_loopback_host("example.com")


def test_every_accepted_telegram_poll_timeout_builds_an_adapter() -> None:
    """``check-config`` must not accept what the adapter refuses at start-up: the config
    took ``poll_timeout_s = 0`` while the adapter needs 1..50, so a checked config crashed
    ``prismd run``."""
    from adapters.telegram import TelegramAdapter
    from prismd.channel import Admission
    from stores.memory import MemoryStore

    async def admit(_event: object) -> Admission:
        return Admission("accepted")

    for value in range(-1, 52):
        data = {
            "connections": [
                {"id": "tg", "kind": "telegram", "token_env": "T", "poll_timeout_s": value}
            ],
            "grants": [{"connection": "tg", "pairing": True, "aliases": ["echo"]}],
            "agents": {"echo": {"kind": "echo"}},
        }
        try:
            config = parse_config(data)
        except ConfigError:
            assert not 1 <= value <= 50, value
            continue
        connection = config.connections[0]
        assert isinstance(connection, TelegramConnectionConfig)
        TelegramAdapter(
            connection_id=connection.id,
            token=lambda: "1:x",
            admit=admit,
            store=MemoryStore(),
            owner_id="o",
            poll_timeout_s=connection.poll_timeout_s,
            max_attachment_bytes=config.limits.max_attachment_bytes,
        )


def test_control_socket_path_too_long_for_bind_is_a_config_error(tmp_path: Path) -> None:
    """A path longer than ``sun_path`` passed check-config and failed at bind()."""
    ok = "/run/" + "a" * 102
    assert parse_config({"control": {"socket": ok}}).control.socket == ok
    with pytest.raises(ConfigError) as info:
        parse_config({"control": {"socket": ok + "a"}}, source="x.toml")
    assert info.value.key == "[control].socket" and "107 bytes" in str(info.value)
