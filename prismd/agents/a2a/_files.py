"""The file parts of a completed task's artifacts, sent with its answer as attachments.

An answer names each file part by reference — ``<task id>/<artifact>/<part>``, the indexes
of the artifact and of the file among its file parts, in the terminal task as ``GetTask``
shows it (a terminal task no longer changes) — with its name, media type and, for a file
sent inline, its size. Nothing of its bytes is journaled: the host asks
:meth:`A2AAgent.open_file` for them when the reply is delivered, and every delivery (a
re-drive after a restart too) reads the task again with ``GetTask`` and then:

* an inline file (v1.0 ``raw``, v0.3 ``bytes``): decoded from base64, within the cap;
* a file by URL (v1.0 ``url``, v0.3 ``uri``): fetched with a GET — ``https://``, or
  ``http://`` for a loopback host only, no redirect followed, the agent's bearer token sent
  only to the agent's own origin —, its ``Content-Length`` checked against the cap before
  the body is read, and the body read no further than the cap.

Anything else is ``"unavailable"`` (the task is gone, the part is not there, the URL is not
allowed or answers an error), ``"too_large"`` over the cap; the host names the file in fixed
words instead. Nothing of a file reaches a log.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Protocol

import httpx

from ...channel import MAX_FILE_NAME_CHARS, MAX_REPLY_FILES, OutboundFile, ReplyFile
from .. import FileProblem, RunResult
from ._client import A2AClient, A2AError, CardError, check_url
from ._wire import FilePart, Task

FETCH_TIMEOUT_S = 30.0
FILES_ONLY = "The remote agent answered with {count}."
"""The reply's text when the answer has files and no text."""


class FileAgent(Protocol):
    """What fetching a file needs of the agent (:class:`._agent.A2AAgent`)."""

    alias: str
    bearer: str | None
    http: httpx.AsyncClient

    async def connect(
        self, hooks: None = None, *, patience_s: float = math.inf
    ) -> A2AClient | None: ...


def inline_size(data_b64: str) -> int:
    """The decoded size of a base64 text (without decoding it)."""
    text = data_b64.strip()
    return max(0, len(text) * 3 // 4 - text[-2:].count("="))


def _name(part: FilePart, artifact: int, index: int) -> str:
    name = "".join(c for c in (part.name or "") if c.isprintable()).strip()
    return name[:MAX_FILE_NAME_CHARS] or f"file-{artifact + 1}-{index + 1}"


def reply_files(alias: str, task: Task) -> tuple[ReplyFile, ...]:
    """The references of ``task``'s file parts (at most :data:`MAX_REPLY_FILES`)."""
    out: list[ReplyFile] = []
    for a, artifact in enumerate(task.artifacts):
        for f, part in enumerate(artifact.files):
            if part.uri is None and part.data_b64 is None:
                continue
            size = None if part.data_b64 is None else inline_size(part.data_b64)
            out.append(
                ReplyFile(alias, f"{task.id}/{a}/{f}", _name(part, a, f), part.media_type, size)
            )
    return tuple(out[:MAX_REPLY_FILES])


def completed(alias: str, task: Task, text: str, run_id: str, session: str) -> RunResult:
    """The answer of a completed task: ``text`` and its files (fixed words when it has
    files and no text of its own)."""
    files = reply_files(alias, task)
    if files and not any(t.strip() for a in task.artifacts for t in a.texts):
        count = "one file" if len(files) == 1 else f"{len(files)} files"
        text = task.status_text or FILES_ONLY.format(count=count)
    return RunResult("succeeded", text, run_id, session, files=files)


def _locate(task: Task, ref: str) -> FilePart | None:
    _task_id, artifact, index = ref.rsplit("/", 2)
    try:
        return task.artifacts[int(artifact)].files[int(index)]
    except (ValueError, IndexError):
        return None


async def open_file(
    agent: FileAgent, file: ReplyFile, max_bytes: int
) -> OutboundFile | FileProblem:
    """See the module: the bytes of one file of a completed task, fetched now."""
    if file.source != agent.alias or file.ref.count("/") < 2:
        return "unavailable"
    if file.size is not None and file.size > max_bytes:
        return "too_large"
    task_id = file.ref.rsplit("/", 2)[0]
    client = await agent.connect(patience_s=FETCH_TIMEOUT_S)
    if client is None:
        return "unavailable"
    try:
        task = await client.get_task(task_id)
    except A2AError:
        return "unavailable"
    part = _locate(task, file.ref)
    if part is None:
        return "unavailable"
    if part.data_b64 is not None:
        if inline_size(part.data_b64) > max_bytes:
            return "too_large"
        try:
            data = base64.b64decode(part.data_b64, validate=False)
        except (binascii.Error, ValueError):
            return "unavailable"
        if len(data) > max_bytes:
            return "too_large"
        return OutboundFile(file.name, file.media_type, data)
    if part.uri is None:
        return "unavailable"
    fetched = await _download(agent, client, part.uri, max_bytes)
    if isinstance(fetched, str):
        return fetched
    data, media_type = fetched
    return OutboundFile(file.name, file.media_type or media_type, data)


async def _download(
    agent: FileAgent, client: A2AClient, uri: str, max_bytes: int
) -> tuple[bytes, str | None] | FileProblem:
    try:
        url = check_url(uri, "a file's URL")
    except CardError:
        return "unavailable"
    headers = {"Accept": "*/*"}
    own = httpx.URL(client.url)
    if agent.bearer and (url.scheme, url.host, url.port) == (own.scheme, own.host, own.port):
        headers["Authorization"] = f"Bearer {agent.bearer}"
    try:
        async with agent.http.stream(
            "GET", url, headers=headers, timeout=FETCH_TIMEOUT_S, follow_redirects=False
        ) as response:
            if response.status_code != 200:
                return "unavailable"
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > max_bytes:
                return "too_large"
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    return "too_large"
                chunks.append(chunk)
            kind = response.headers.get("content-type")
            return b"".join(chunks), (kind.split(";")[0].strip() or None) if kind else None
    except httpx.HTTPError:
        return "unavailable"
