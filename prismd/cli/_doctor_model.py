"""``prismd doctor``'s look at an ``openai`` agent's model server: ``GET <base_url>/models``
(one one-token chat completion when the server has no such list), with the configured key.

The key is sent, never shown; a failure is described by its status or cause class.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
import trio

from ..daemon import ConfigError, read_secret
from ._finding import Finding, failed, ok


def _key_source(options: Mapping[str, Any]) -> str | None:
    if "api_key_env" in options:
        return f"api_key_env {options['api_key_env']}"
    if "api_key_file" in options:
        return f"api_key_file {options['api_key_file']}"
    return None


def _refused(alias: str, name: str, options: Mapping[str, Any], status: int) -> Finding:
    source = _key_source(options)
    if source is None:
        return failed(
            name,
            f"the server wants an API key (HTTP {status}) and none is configured; set"
            f" api_key_env (or api_key_file) in [agents.{alias}]",
        )
    return failed(name, f"the server refused the API key (HTTP {status}); check {source}")


async def check_model_server(
    alias: str, options: Mapping[str, Any], env: Mapping[str, str], timeout_s: float
) -> Finding:
    """One finding for the model server of agent ``alias``."""
    base_url = str(options.get("base_url", "")).rstrip("/")
    model = str(options.get("model", ""))
    name = f"model server {alias} ({base_url})"
    headers = {}
    if _key_source(options) is not None:
        try:
            key = read_secret(
                env_name=options.get("api_key_env"),
                file_name=options.get("api_key_file"),
                env=env,
                key=f"[agents.{alias}]",
            )
        except ConfigError as exc:
            return failed(name, f"{exc.message}; put the API key there")
        headers["authorization"] = f"Bearer {key}"
    with trio.move_on_after(timeout_s):
        try:
            async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as client:
                listing = await client.get(f"{base_url}/models")
                if listing.status_code == 404:
                    tiny = {
                        "model": model,
                        "messages": [{"role": "user", "content": "ping"}],
                        "max_tokens": 1,
                    }
                    answer = await client.post(f"{base_url}/chat/completions", json=tiny)
                    return _judge_completion(alias, name, options, answer.status_code)
                return _judge_listing(alias, name, options, model, listing)
        except httpx.HTTPError as exc:
            return failed(
                name,
                f"not reachable ({type(exc).__name__}); is the server running, is base_url right?",
            )
    return failed(name, f"no answer within {timeout_s:g} s; is the server running?")


def _judge_listing(
    alias: str, name: str, options: Mapping[str, Any], model: str, listing: httpx.Response
) -> Finding:
    status = listing.status_code
    if status in (401, 403):
        return _refused(alias, name, options, status)
    if status != 200:
        return failed(name, f"GET /models answered HTTP {status}; is base_url right (…/v1)?")
    try:
        data = listing.json().get("data")
        served = [str(m.get("id")) for m in data if isinstance(m, Mapping)]
    except (ValueError, AttributeError, TypeError):
        return ok(name, "answers")
    if served and model not in served:
        shown = ", ".join(served[:5]) + (", …" if len(served) > 5 else "")
        return Finding(
            name, "warning", f"it does not list model {model!r} (it lists {shown}); check model"
        )
    return ok(name, f"serves {model}")


def _judge_completion(alias: str, name: str, options: Mapping[str, Any], status: int) -> Finding:
    if status in (401, 403):
        return _refused(alias, name, options, status)
    if status == 404:
        return failed(name, "no chat completions endpoint there; base_url usually ends in /v1")
    if status >= 400:
        return failed(name, f"a one-token request answered HTTP {status}; check model")
    return ok(name, "answers a one-token request")
