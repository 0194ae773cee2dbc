"""One streamed chat completion against an OpenAI-compatible server (``POST …/chat/completions``).

The response is read as Server-Sent Events by ``httpx-sse``, chunk by chunk: text deltas are
handed to ``on_text`` as they arrive, tool calls (whose id, name and JSON arguments may be
split over many chunks) are assembled by their ``index``.

Failures are :class:`ProviderError` with a fixed, bounded message (never the server's body:
OpenAI's 401 quotes part of the key). Before the first token a 429 (after ``Retry-After``),
a 5xx or a dropped connection is retried with backoff, at most :data:`MAX_ATTEMPTS` times;
after the first token nothing is retried (the user already saw text that a second answer
would contradict).

Cancellation is Trio's: leaving the ``async with client.stream(…)`` block by cancellation
closes the response and with it the HTTP connection (httpx never returns a half-read
connection to its pool).
"""

from __future__ import annotations

import email.utils
import functools
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

import attrs
import httpx
import httpx_sse
import trio

log = logging.getLogger("prismd.agents.openai")

MAX_ATTEMPTS = 4
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 8.0
MAX_RETRY_AFTER_S = 60.0
"""A server asking to wait longer than this is answered with a failure, not a minute-long
silence in the chat."""
MAX_TEXT_CHARS = 200_000
MAX_TOOL_CALLS = 16
MAX_ARGUMENT_CHARS = 32 * 1024


class ProviderError(Exception):
    """A completion failed. ``code`` is a bounded error code, ``str(error)`` a fixed text
    without any value from the server; ``started`` is true when tokens had arrived."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        retryable: bool = False,
        retry_after_s: float | None = None,
        started: bool = False,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.retryable = retryable
        self.retry_after_s = retry_after_s
        self.started = started


@attrs.frozen
class ToolCall:
    id: str
    name: str
    arguments: str


@attrs.frozen
class Completion:
    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str | None = None


def retry_after_seconds(headers: httpx.Headers, now: float | None = None) -> float | None:
    """``retry-after-ms`` (OpenAI's), else ``Retry-After`` as seconds or an HTTP date."""
    raw_ms = headers.get("retry-after-ms")
    if raw_ms is not None:
        try:
            value = float(raw_ms) / 1000
        except ValueError:
            value = math.nan
        if math.isfinite(value) and value >= 0:
            return value
    raw = headers.get("retry-after")
    if raw is None:
        return None
    raw = raw.strip()
    try:
        seconds = float(raw)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(raw)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


def _status_error(response: httpx.Response) -> ProviderError:
    status = response.status_code
    if status == 429:
        return ProviderError(
            "provider_rate_limited",
            "the model server is rate limiting requests (HTTP 429); try again later",
            retryable=True,
            retry_after_s=retry_after_seconds(response.headers),
        )
    if status >= 500:
        return ProviderError(
            "provider_unavailable",
            f"the model server failed (HTTP {status}); try again later",
            retryable=True,
            retry_after_s=retry_after_seconds(response.headers),
        )
    if status in (401, 403):
        return ProviderError(
            "provider_unauthorized",
            f"the model server refused the API key (HTTP {status})",
        )
    if status == 404:
        return ProviderError(
            "provider_not_found",
            "the model server does not know this model or URL (HTTP 404)",
        )
    return ProviderError(
        "provider_rejected", f"the model server rejected the request (HTTP {status})"
    )


@attrs.define
class _Assembler:
    """Accumulates one streamed assistant message."""

    on_text: Callable[[str], None]
    text: list[str] = attrs.field(factory=list)
    chars: int = 0
    calls: dict[int, dict[str, Any]] = attrs.field(factory=dict)
    finish_reason: str | None = None
    started: bool = False

    def feed(self, chunk: Any) -> None:
        if not isinstance(chunk, Mapping):
            raise ProviderError("provider_bad_stream", "the model server sent an unreadable stream")
        if "error" in chunk:
            # vLLM and llama.cpp report a failure inside the stream as an error object.
            raise ProviderError(
                "provider_stream_error", "the model server reported an error mid-answer"
            )
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices:
            return  # a usage-only chunk (stream_options) or a keep-alive
        choice = choices[0]
        if not isinstance(choice, Mapping):
            return
        delta = choice.get("delta")
        if isinstance(delta, Mapping):
            content = delta.get("content")
            if isinstance(content, str) and content:
                self.started = True
                if self.chars + len(content) <= MAX_TEXT_CHARS:
                    self.text.append(content)
                    self.chars += len(content)
                    self.on_text(content)
            tool_calls = delta.get("tool_calls")
            if isinstance(tool_calls, list):
                for part in tool_calls:
                    self._tool_part(part)
        reason = choice.get("finish_reason")
        if isinstance(reason, str):
            self.finish_reason = reason

    def _tool_part(self, part: Any) -> None:
        if not isinstance(part, Mapping):
            return
        index = part.get("index", len(self.calls))
        if not isinstance(index, int) or isinstance(index, bool):
            return
        self.started = True
        call = self.calls.get(index)
        if call is None:
            if len(self.calls) >= MAX_TOOL_CALLS:
                return
            call = self.calls[index] = {"id": "", "name": "", "arguments": []}
        if isinstance(part.get("id"), str) and part["id"]:
            call["id"] = part["id"]
        function = part.get("function")
        if isinstance(function, Mapping):
            name = function.get("name")
            if isinstance(name, str) and name:
                call["name"] = name
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                call["arguments"].append(arguments)
            elif isinstance(arguments, Mapping):
                # Ollama sends the arguments as an object in one chunk.
                call["arguments"].append(json.dumps(arguments))

    def completion(self) -> Completion:
        calls = []
        for position, (_index, call) in enumerate(sorted(self.calls.items())):
            if not call["name"]:
                continue
            arguments = "".join(call["arguments"])[:MAX_ARGUMENT_CHARS]
            calls.append(ToolCall(call["id"] or f"call_{position}", call["name"], arguments))
        return Completion("".join(self.text), tuple(calls), self.finish_reason)


OpenStream = Callable[[], AbstractAsyncContextManager[httpx_sse.EventSource]]
"""Sends the request, once per call: the answer's event stream while the block runs."""


async def _attempt(open_stream: OpenStream, on_text: Callable[[str], None]) -> Completion:
    assembler = _Assembler(on_text)
    try:
        async with open_stream() as source:
            response = source.response
            if response.status_code != 200:
                # The body is never read (nor shown): OpenAI's 401 quotes part of the key.
                raise _status_error(response)
            outcome = await _read_events(source, assembler)
            if isinstance(outcome, ProviderError):
                raise outcome
            if outcome is not None:
                return outcome
            # The stream ended without [DONE]: complete only if the model said it finished
            # (some servers omit [DONE]); otherwise the connection broke off.
            if assembler.finish_reason is not None:
                return assembler.completion()
            raise ProviderError(
                "provider_stream_broken",
                "the model server's answer broke off",
                retryable=not assembler.started,
                started=assembler.started,
            )
    except ProviderError as error:
        error.started = error.started or assembler.started
        if error.started:
            error.retryable = False
        raise
    except httpx_sse.SSEError:
        raise ProviderError(
            "provider_bad_stream", "the model server did not answer with an event stream"
        ) from None
    except httpx.TimeoutException:
        raise ProviderError(
            "provider_timeout",
            "the model server did not answer within timeout_ms",
            started=assembler.started,
        ) from None
    except httpx.ConnectError:
        raise ProviderError(
            "provider_unreachable", "cannot reach the model server", retryable=True
        ) from None
    except (httpx.TransportError, httpx.DecodingError):
        raise ProviderError(
            "provider_stream_broken",
            "the model server's answer broke off",
            retryable=not assembler.started,
            started=assembler.started,
        ) from None
    except Exception as exc:
        # Anything else (an odd URL, a library error): the type only, never its text, which
        # may quote the request (its Authorization header included).
        raise ProviderError(
            "provider_error",
            f"the model request failed ({type(exc).__name__})",
            started=assembler.started,
        ) from None


async def _read_events(
    source: httpx_sse.EventSource, assembler: _Assembler
) -> Completion | ProviderError | None:
    """Feed every event to ``assembler``: the completion at ``[DONE]``, an error for a bad
    chunk, ``None`` when the stream ended first.

    The event iterator is always run to its end (after an early outcome the response is
    closed, which ends it): an async generator left suspended mid-stream would only be
    finalized by the garbage collector.
    """
    outcome: Completion | ProviderError | None = None
    try:
        async for event in source.aiter_sse():
            if outcome is not None:
                continue
            data = event.data.strip()
            if data == "[DONE]":
                outcome = assembler.completion()
            elif data:
                try:
                    assembler.feed(json.loads(data))
                except ValueError:
                    outcome = ProviderError(
                        "provider_bad_stream", "the model server sent an unreadable stream"
                    )
                except ProviderError as error:
                    outcome = error
            if outcome is not None:
                await source.response.aclose()
    except Exception:
        if outcome is None:
            raise
    return outcome


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    on_text: Callable[[str], None],
    *,
    max_attempts: int = MAX_ATTEMPTS,
) -> Completion:
    """One completion, retried before the first token (see the module docstring).

    Raises :class:`ProviderError`; ``trio.Cancelled`` closes the request.
    """
    open_stream = functools.partial(
        httpx_sse.aconnect_sse, client, "POST", url, headers=dict(headers), json=dict(body)
    )
    delay = BACKOFF_START_S
    for attempt in range(1, max_attempts + 1):
        try:
            return await _attempt(open_stream, on_text)
        except ProviderError as error:
            if not error.retryable or error.started or attempt == max_attempts:
                raise
            wait = delay if error.retry_after_s is None else error.retry_after_s
            if wait > MAX_RETRY_AFTER_S:
                raise
            log.info(
                "model server answered %s; retry %d of %d in %.1f s",
                error.code,
                attempt,
                max_attempts - 1,
                wait,
            )
            await trio.sleep(wait)
            delay = min(delay * 2, BACKOFF_MAX_S)
    raise AssertionError("unreachable")
