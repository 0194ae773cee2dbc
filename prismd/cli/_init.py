"""``prismd init``: write a commented starter config that runs as written, and say what next.

The web chat is always in it; each :data:`STARTER_CONNECTIONS` entry adds its flag
(``--telegram``) and, when asked for, its ``[[connections]]`` block, its grant and the
variables to export. ``--openai URL`` makes the agent an ``openai`` one (the echo agent
otherwise). Secrets appear as the names of environment variables, never as values. An
existing file is never overwritten (exit 1).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from collections.abc import Callable
from typing import TextIO

import attrs

from ._ctlsocket import DEFAULT_CONFIG_FILE, WEB_LISTEN

OPENAI_ALIAS = "assistant"
OPENAI_KEY_ENV = "OPENAI_API_KEY"
DEFAULT_MODEL = "gpt-4o-mini"


@attrs.frozen
class StarterConnection:
    """One connection kind ``prismd init`` can write. A kind adds itself here (its flag,
    block and next steps) and nowhere else in this module."""

    name: str
    """The flag (``--<name>``) and the connection id."""
    help: str
    block: Callable[[str], str]
    """``block(aliases)``: the commented ``[[connections]]`` and ``[[grants]]`` TOML, given
    the grant's ``aliases = […]`` value."""
    exports: tuple[tuple[str, str], ...] = ()
    """``(variable, what to put in it)`` the connection reads at start."""
    then: str = ""
    """What to do once the daemon runs (one line)."""
    always: bool = False
    """Written whatever the flags (no flag of its own)."""


def _webchat_block(aliases: str) -> str:
    return f"""
# The web chat: open http://{WEB_LISTEN}/ in a browser (or run `prismctl chat`).
[[connections]]
id = "web"
kind = "webchat"
listen = "{WEB_LISTEN}"   # loopback only; another address needs access_token_env

[[grants]]
connection = "web"
actors = ["*"]             # anyone who reaches the loopback port may talk
aliases = {aliases}
"""


def _paired_bot(
    name: str, label: str, token_what: str, about: str, options: str, send: str
) -> StarterConnection:
    """A bot connection whose users pair: its token read from ``<NAME>_BOT_TOKEN``
    (``token_what`` says what to put there), ``about`` (comment lines) above its block, its
    commented ``options`` lines in it, and how a user sends the bot its pairing code."""
    token_env = f"{name.upper()}_BOT_TOKEN"

    def block(aliases: str) -> str:
        token = f'token_env = "{token_env}"'.ljust(35)
        return f"""
{about}
[[connections]]
id = "{name}"
kind = "{name}"
{token}# or token_file = "/path/to/token"
{options}

[[grants]]
connection = "{name}"
pairing = true             # who may talk: those who pair with `prismctl pair`
aliases = {aliases}
"""

    return StarterConnection(
        name=name,
        help=f"add a {label} bot connection (token from ${token_env}), paired users only",
        block=block,
        exports=((token_env, token_what),),
        then=f"prismctl pair --connection {name}, then {send} the bot '/pair TOKEN'",
    )


STARTER_CONNECTIONS: tuple[StarterConnection, ...] = (
    StarterConnection(
        name="web",
        help="",
        block=_webchat_block,
        then=f"open http://{WEB_LISTEN}/ and say hello",
        always=True,
    ),
    _paired_bot(
        "telegram",
        "Telegram",
        "the token @BotFather gave you",
        "# Telegram: a bot made with @BotFather; its token is read from TELEGRAM_BOT_TOKEN.",
        '# api_origin = "https://api.telegram.org"',
        send="send",
    ),
    _paired_bot(
        "discord",
        "Discord",
        "the bot token of the developer portal",
        "# Discord: a bot of the developer portal (docs/discord.md); its token is read from\n"
        "# DISCORD_BOT_TOKEN. Direct messages only until allow_guilds = true.",
        "# allow_guilds = false             # true: answer in servers too (when mentioned)\n"
        '# respond_to = "mentions"          # "all": every message there (needs the message'
        " content intent)",
        send="DM",
    ),
)


def add_init_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--path",
        default=DEFAULT_CONFIG_FILE,
        metavar="PATH",
        help=f"where to write it (default: ./{DEFAULT_CONFIG_FILE}); never overwritten",
    )
    for part in STARTER_CONNECTIONS:
        if not part.always:
            parser.add_argument(f"--{part.name}", action="store_true", help=part.help)
    parser.add_argument(
        "--openai",
        metavar="URL",
        help="answer with an OpenAI-compatible model server at URL (e.g."
        " https://api.openai.com/v1, or a local http://127.0.0.1:8080/v1); default: echo",
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"the model name for --openai ({DEFAULT_MODEL})"
    )


def _agent_block(url: str | None, model: str) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    """The ``[agents]`` TOML, the alias it defines, the variables it reads."""
    if url is None:
        text = """
# The agent that answers. "echo" repeats each message: it proves the whole path. For a
# model, run `prismd init --openai URL` (docs/models.md).
[agents.echo]
kind = "echo"
"""
        return text, "echo", ()
    from adapters.toolkit import is_loopback_host

    from ..agents.openai import check_base_url

    base_url = check_base_url(url)
    host = base_url.partition("://")[2].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
    local = is_loopback_host(host)
    key_line = (
        f'# api_key_env = "{OPENAI_KEY_ENV}"   # a local server usually needs no key'
        if local
        else f'api_key_env = "{OPENAI_KEY_ENV}"   # the API key is read from this variable'
    )
    text = f"""
# The agent that answers: an OpenAI-compatible chat completions server.
[agents.{OPENAI_ALIAS}]
kind = "openai"
base_url = "{base_url}"
model = {_toml_string(model)}   # a name the server serves (GET <base_url>/models lists them)
{key_line}
# system_prompt = "You are a helpful assistant."
"""
    exports = () if local else ((OPENAI_KEY_ENV, "your API key"),)
    return text, OPENAI_ALIAS, exports


def _toml_string(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def starter_config(args: argparse.Namespace) -> tuple[str, list[tuple[str, str]], list[str]]:
    """The config text, the variables to export and the lines of what to do once it runs.
    Raises ``ValueError`` (its text says why) for a bad ``--openai`` URL."""
    agents, alias, exports = _agent_block(args.openai, args.model)
    chosen = [p for p in STARTER_CONNECTIONS if p.always or getattr(args, p.name, False)]
    head = f"""# prismd config, written by `prismd init`. Check it: prismd check-config {args.path}
# Every key, its default and limits: docs/configuration.md.
# Secrets are never in this file: *_env keys name the environment variables holding them.

[daemon]
state_dir = "var"                   # instance id and lock (relative to where prismd runs)

[store]
url = "sqlite:///var/journal.sqlite"   # postgresql://… for several instances

[control]
socket = "var/run/control.sock"     # where prismctl reaches the daemon
"""
    blocks = "".join(part.block(f'["{alias}"]') for part in chosen)
    variables = [*exports, *(pair for part in chosen for pair in part.exports)]
    return head + agents + blocks, variables, [p.then for p in chosen if p.then]


def run_init_command(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Write the starter config to ``args.path`` (never over a file): 0, or 1 saying why."""
    try:
        text, variables, then = starter_config(args)
    except ValueError as exc:
        print(f"prismd init: --openai: {exc}", file=sys.stderr)
        return 1
    path = args.path
    try:
        with open(path, "x", encoding="utf-8") as file:
            file.write(text)
    except FileExistsError:
        print(
            f"prismd init: {path} exists; it is not overwritten (move it away, or write"
            " another file with --path PATH)",
            file=sys.stderr,
        )
        return 1
    except OSError as exc:
        print(f"prismd init: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    config = os.fspath(path)
    prismd, prismctl = _as_typed("prismd"), _as_typed("prismctl")
    out.write(f"wrote {config}\nnext:\n")
    for variable, what in variables:
        out.write(f"  export {variable}=…   # {what}\n")
    out.write(f"  {prismd} check-config {config}\n  {prismd} run --config {config}\n")
    for line in then:
        out.write(f"then: {line.replace('prismctl ', f'{prismctl} ', 1)}\n")
    url = getattr(args, "openai", None)
    if url is not None and not url.rstrip("/").endswith("/v1"):
        out.write(
            f"note: {url} does not end in /v1, where OpenAI, llama.cpp, vLLM and Ollama serve"
            f" the API; if that is wrong, edit base_url ({prismd} doctor asks the server)\n"
        )
    return 0


def _as_typed(tool: str) -> str:
    """How to type ``tool`` here: its name when ``PATH`` finds this installation's, else the
    path this ``prismd`` was started by (``.venv/bin/prismd`` in a clone after ``make run``,
    where a bare ``prismd`` is "command not found") with ``tool`` beside it."""
    started = sys.argv[0] if sys.argv else ""
    if os.path.basename(started) != "prismd":
        return tool  # python -m prismd, or embedded: nothing better to say
    script = os.path.join(os.path.dirname(started), tool)
    found = shutil.which(tool)
    if found is not None and os.path.realpath(found) == os.path.realpath(script):
        return tool
    return shlex.quote(script)
