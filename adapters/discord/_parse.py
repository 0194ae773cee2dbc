"""A ``MESSAGE_CREATE`` (gateway or fetched for a backfill) → :class:`InboundEvent`.

* The event id is the message id (snowflake): the journal's dedup key, never the gateway
  sequence (which restarts every session).
* Ignored: the bot's own messages (``author.id`` = the bot's user id), other bots and
  webhooks, system messages (types other than 0 DEFAULT and 19 REPLY), guild messages
  unless ``allow_guilds``, and in guild channels with ``respond_to = "mentions"`` a
  message that does not mention the bot (in ``mentions``, or ``<@id>`` / ``<@!id>`` in its
  text: a payload may leave the optional list out).
* Images attached (``content_type`` ``image/…``) become attachment refs (:mod:`._media`);
  a message of images alone is admitted with empty text.
* A **forward** (a ``message_reference`` of type 1, FORWARD) has no content of its own:
  the forwarded message's text and images (its ``message_snapshots`` entry) are the
  message's, and its claims say ``forwarded`` (journaled, as a Telegram forward's). A
  forward mentions no one: in a guild channel it is answered only with
  ``respond_to = "all"``.
* The bot's own ``<@id>`` is stripped before the agent sees the text, so ``@bot /new`` is
  the command ``/new``. Conversation = the channel id (a thread is its own channel); actor
  = the author's user id (grants and ``/pair`` by Discord user id).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from prismd.channel import InboundEvent

from ._media import document_refs, image_refs
from ._protocol import forwarded, strip_mention

USER_MESSAGE_TYPES = frozenset({0, 19})
RespondTo = Literal["mentions", "all"]


def snowflake_ms(snowflake: str) -> int | None:
    """The creation time of a snowflake (ms since the Unix epoch)."""
    if not snowflake.isdigit() or len(snowflake) > 20:
        return None
    return (int(snowflake) >> 22) + 1420070400000


def _id(value: object) -> str | None:
    return value if isinstance(value, str) and value.isdigit() and len(value) <= 20 else None


def parse_message(
    message: Mapping[str, Any],
    *,
    connection_id: str,
    bot_user_id: str | None,
    allow_guilds: bool,
    respond_to: RespondTo,
    guild_id: str | None = None,
) -> InboundEvent | None:
    """The event to admit, or ``None`` (ignored; see the module docstring).

    ``guild_id`` is given for fetched messages (history carries none); a gateway event
    has its own.
    """
    message_id = _id(message.get("id"))
    channel_id = _id(message.get("channel_id"))
    author = message.get("author")
    if message_id is None or channel_id is None or not isinstance(author, Mapping):
        return None
    author_id = _id(author.get("id"))
    if author_id is None or author_id == bot_user_id:
        return None
    if author.get("bot") is True or author.get("system") is True:
        return None
    if message.get("webhook_id") is not None:  # (a null one is no webhook)
        return None
    if message.get("type", 0) not in USER_MESSAGE_TYPES:
        return None
    guild = _id(message.get("guild_id")) or guild_id
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    in_text = False
    if bot_user_id is not None:
        text, in_text = strip_mention(text, bot_user_id)
    if guild is not None:
        if not allow_guilds:
            return None
        mentions = message.get("mentions")
        mentioned = in_text or (
            bot_user_id is not None
            and isinstance(mentions, list)
            and any(isinstance(m, Mapping) and m.get("id") == bot_user_id for m in mentions)
        )
        if respond_to == "mentions" and not mentioned:
            return None
    source = message
    inner = forwarded(message) if not text.strip() else None
    if inner is not None:
        # Its text and files under the forward's own ids (the refs name them).
        source = {**inner, "id": message_id, "channel_id": channel_id}
        content = inner.get("content")
        text = content if isinstance(content, str) else ""
    attachments = image_refs(source, connection_id)
    if not text.strip() and not attachments:
        # Only files the agent cannot take: the runtime's notice answers them (their size
        # counts only then: with text or images they are left out, never downloaded).
        attachments = document_refs(source, connection_id)
        if not attachments:
            return None
    claims: dict[str, Any] = {"platform": "discord", "chatType": "guild" if guild else "dm"}
    if inner is not None:
        claims["forwarded"] = True
    return InboundEvent(
        connection_id=connection_id,
        external_conversation_id=channel_id,
        external_actor_id=author_id,
        event_id=message_id,
        text=text,
        attachments=attachments,
        received_at_ms=snowflake_ms(message_id),
        claims=claims,
    )
