"""Delivering a reply that carries files (:attr:`prismd.channel.Reply.files`): the host
fetches each from the agent that answered (a :class:`~prismd.agents.FileSource`), within
the channel's cap (``AdapterFeatures.max_file_bytes``), sends the reply's text and then each
file through :meth:`~prismd.channel.ChannelAdapter.send_file`.

* **The bytes are never journaled**: the reply record names each file by reference, and
  every delivery — the first, a re-drive of a held reply, an operator's resend — fetches
  them again. Nothing is fetched for a channel that sends no files.
* **The text first**: files are fetched only once the reply's text was delivered (a held
  reply — the web chat with no tab open — fetches nothing until it is shown), then sent one
  by one after it.
* **What is not sent is said, in fixed words** naming the file and its size when known: in
  the reply's text when it is known before fetching (the channel sends no files, a size
  over the channel's cap), else in one notice after the files (over the cap, not fetchable,
  refused by the channel). Nothing of a file (name, type, bytes) reaches a log.
* The reply's outcome is its text's; a file whose send ends unknown is logged by class,
  never retried.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import attrs
import trio

from ..agents import Agent, FileProblem, FileSource
from ..channel import ChannelAdapter, OutboundFile, Reply, ReplyFile, SendResult

log = logging.getLogger("prismd.files")

FETCH_BUDGET_S = 60.0
"""How long fetching one file may take before it counts as not fetchable."""
FILES_SUFFIX = "~files"
"""Appended to the reply's id for the notice about files the channel refused."""


def size_text(size: int | None) -> str:
    if size is None:
        return ""
    if size < 1024:
        return f" ({size} bytes)"
    if size < 1024 * 1024:
        return f" ({(size + 1023) // 1024} KB)"
    return f" ({size / (1024 * 1024):.1f} MB)"


def limit_text(cap: int) -> str:
    return size_text(cap).strip(" ()")


def note(problem: str, file: ReplyFile, cap: int, size: int | None = None) -> str:
    """The fixed words for a file that was not sent (its name is the agent's text)."""
    named = f'The file "{file.name}"{size_text(file.size if size is None else size)}'
    if problem == "channel":
        return f"{named} was not sent: this chat cannot receive files."
    if problem == "too_large":
        return f"{named} was not sent: it is larger than this chat's limit of {limit_text(cap)}."
    if problem == "refused":
        return f"{named} could not be sent."
    return f"{named} was not sent: it could not be fetched."


async def fetch(
    agents: Mapping[str, Agent], file: ReplyFile, cap: int
) -> OutboundFile | FileProblem:
    """``file``'s bytes from its source agent, within ``cap`` and :data:`FETCH_BUDGET_S`."""
    if file.size is not None and file.size > cap:
        return "too_large"
    source = agents.get(file.source)
    if not isinstance(source, FileSource):
        return "unavailable"
    opened: OutboundFile | FileProblem = "unavailable"
    with trio.move_on_after(FETCH_BUDGET_S):
        try:
            opened = await source.open_file(file, cap)
        except Exception as exc:
            log.warning("fetching a reply's file failed (%s)", type(exc).__name__)
            opened = "unavailable"
    if isinstance(opened, OutboundFile) and len(opened.data) > cap:
        return "too_large"
    return opened


async def deliver_with_files(
    adapter: ChannelAdapter, reply: Reply, agents: Mapping[str, Agent]
) -> SendResult:
    """Deliver ``reply``'s text, then its files (see the module). Raises as
    :meth:`~prismd.channel.ChannelAdapter.send` does for the text."""
    cap = adapter.features.max_file_bytes
    notes: list[str] = []
    wanted: list[ReplyFile] = []
    for file in reply.files:
        if cap <= 0:
            notes.append(note("channel", file, cap))
        elif file.size is not None and file.size > cap:
            notes.append(note("too_large", file, cap))
        else:
            wanted.append(file)
    text = "\n\n".join([reply.text, "\n".join(notes)]) if notes else reply.text
    result = await adapter.send(attrs.evolve(reply, text=text, files=()))
    if not result.delivered:
        return result  # held or refused: nothing fetched, nothing more sent
    late: list[str] = []
    for file in wanted:
        opened = await fetch(agents, file, cap)
        if not isinstance(opened, OutboundFile):
            late.append(note(opened, file, cap))
            continue
        try:
            sent = await adapter.send_file(reply, opened)
        except Exception as exc:
            log.warning("a reply's file: delivery outcome unknown (%s)", type(exc).__name__)
            continue
        if not sent.delivered:
            late.append(note("refused", file, cap, len(opened.data)))
    if late:
        notice = attrs.evolve(
            reply,
            text="\n".join(late),
            kind="notice",
            buttons=(),
            files=(),
            operation_id=None if reply.operation_id is None else reply.operation_id + FILES_SUFFIX,
        )
        try:
            await adapter.send(notice)
        except Exception as exc:
            log.warning("a notice about a reply's files failed (%s)", type(exc).__name__)
    return result
