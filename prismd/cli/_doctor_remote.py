"""``prismd doctor``'s live checks of the remote parties added in wave 3: a Discord bot token
(``GET /users/@me``) and each ``a2a`` agent's card. One :class:`~._finding.Finding` each;
never a token or a remote's own text in a line."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
import trio

from ..daemon import ConfigError, read_secret
from ._finding import Finding, failed, ok

__all__ = ["check_a2a_agent", "check_discord"]


async def check_discord(conn: Any, env: Mapping[str, str], timeout_s: float) -> Finding:
    """The bot token answers ``GET /api/v10/users/@me`` (the bot's name shown)."""
    name = f"Discord {conn.id}"
    variable = conn.token_env or conn.token_file
    try:
        token = read_secret(env_name=conn.token_env, file_name=conn.token_file, env=env)
    except ConfigError as exc:
        return failed(name, f"{exc.message}: put the bot token from the developer portal there")
    from adapters.discord import DiscordApiError, DiscordError, DiscordRest

    rest = DiscordRest(token=lambda: token, api_origin=conn.api_origin, timeout_s=timeout_s)
    try:
        with trio.move_on_after(timeout_s):
            try:
                me = await rest.request("GET", "/users/@me")
            except DiscordApiError as exc:
                if exc.status == 401:
                    return failed(
                        name,
                        f"Discord refused the token (HTTP 401); reset it in the portal,"
                        f" check {variable}",
                    )
                return failed(name, f"Discord answered HTTP {exc.status}; try again later")
            except DiscordError as exc:
                return failed(
                    name, f"{exc}; check the network, a proxy or api_origin ({conn.api_origin})"
                )
            bot = me.get("username") if isinstance(me, Mapping) else None
            where = f"{conn.respond_to} in servers" if conn.allow_guilds else "direct messages"
            return ok(name, f"bot {bot or '(no name)'}, {where}")
    finally:
        with trio.move_on_after(1, shield=True):
            await rest.aclose()
    return failed(name, f"{conn.api_origin} did not answer within {timeout_s:g} s")


async def check_a2a_agent(
    alias: str, options: Mapping[str, Any], env: Mapping[str, str], timeout_s: float
) -> Finding:
    """The agent's card can be fetched and offers a JSON-RPC interface (its dialect, push
    and streaming shown)."""
    from ..agents.a2a import A2AClient, CardError, OutcomeUnknown, Refused

    where = options.get("card_url") or options.get("url")
    name = f"A2A agent {alias} ({where})"
    bearer: str | None = None
    if "bearer_token_env" in options or "bearer_token_file" in options:
        try:
            bearer = read_secret(
                env_name=options.get("bearer_token_env"),
                file_name=options.get("bearer_token_file"),
                env=env,
            )
        except ConfigError as exc:
            return failed(name, exc.message)
    with trio.move_on_after(timeout_s):
        async with httpx.AsyncClient(trust_env=False) as http:
            try:
                client = await A2AClient.discover(
                    http,
                    url=options.get("url"),
                    card_url=options.get("card_url"),
                    bearer=bearer,
                    protocol=str(options.get("protocol", "auto")),
                    timeout_s=timeout_s,
                )
            except CardError as exc:
                return failed(name, f"{exc}; check url or card_url")
            except Refused:
                return failed(
                    name, "the agent refused (down, or HTTP 429/503): start it, or check url"
                )
            except (OutcomeUnknown, httpx.HTTPError) as exc:
                return failed(name, f"not reachable ({type(exc).__name__}); check url")
        card = client.card
        return ok(
            name,
            f"card of {card.name or 'an unnamed agent'}: A2A {card.dialect},"
            f" push {'yes' if card.push else 'no'}, streaming {'yes' if card.streaming else 'no'}",
        )
    return failed(name, f"no card within {timeout_s:g} s")
