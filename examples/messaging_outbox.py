"""A host that keeps its own PostgreSQL outbox for prismd's replies (the "PostgreSQL outbox
composition" of the messaging channel operations guide).

The host embeds the messaging runtime (journal on PostgreSQL) and gives it a ``deliver`` of
its own. For each reply, ``deliver`` opens a connection the *host* owns and, in one
transaction, makes its business change (the reply is recorded on the chat's ticket, which is
marked answered) and appends the reply to its outbox table: ``BEGIN`` → business change +
append → ``COMMIT``. Only then is the reply sent, through the Telegram adapter's ``send``.

* **Idempotent append.** The outbox is keyed on ``(tenant_id, message_id)``, the message id
  being the operation the reply answers: a repeated ``deliver`` for the same reply appends
  nothing and changes nothing, and sends only if the row was never sent.
* **Correlation ids only.** An outbox row's payload is ``connectionId``, ``eventId``,
  ``operationId`` and ``kind`` — never the prompt or the reply text. The text is the host's
  business record (its ticket's reply), read when the row is sent.
* **Re-driven from the outbox.** An external send cannot be rolled back, so the committed
  row is the durable record: a crash between ``COMMIT`` and the send leaves an unsent row,
  and ``--redrive`` (any instance, any time) claims unsent rows (``FOR UPDATE SKIP
  LOCKED``, a claim that expires), sends them and acknowledges each after its send. A row is
  sent at most once unless the process dies between a send and its acknowledgement — the
  one window no outbox can close.
* The tenant is the one of the grant that admitted the message (the resolved identity's
  ownership scope); this host serves one connection with one grant.

Run (the Bot API token in ``$TELEGRAM_TOKEN``)::

    python examples/messaging_outbox.py --store postgresql://…?schema=desk \\
        --telegram-origin https://api.telegram.org --chat 101 --event-id e1 --text hello
    python examples/messaging_outbox.py --store … --telegram-origin … --redrive

The first form admits one message (as if chat ``--chat`` sent it, update ``--event-id``),
lets the ``echo`` agent answer, and prints a JSON line: the admission and the outbox row.
``--crash-after-commit`` exits with status 3 right after the outbox ``COMMIT``, before the
send (what a crash there leaves behind). ``--redrive`` sends what is unsent and prints how
many it sent. ``tests/examples/test_messaging_outbox.py`` runs all of this against the
suite's PostgreSQL server and the fake Bot API.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio

from adapters.telegram import TelegramAdapter
from prismd.agents import AgentContext, build_agent
from prismd.channel import InboundEvent, Reply, SendResult
from prismd.grants import GrantAuthorizer, GrantConfig
from prismd.runtime import open_messaging_runtime
from stores import open_store

CONNECTION = "tg"
TENANT = "desk-tenant"
ALIAS = "echo"
CLAIM_TTL_S = 60
"""How long a claimed outbox row is this sender's; after that another may send it."""
REDRIVE_BATCH = 100
CRASH_EXIT = 3

Send = Callable[[Reply], Awaitable[SendResult]]


GRANT = GrantConfig(CONNECTION, ("*",), tenant=TENANT, aliases=(ALIAS,), default_alias=ALIAS)
"""The one grant of this host: anyone on the connection may talk to ``echo``, as a user of
:data:`TENANT`."""


def _schema_of(url: str) -> str:
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))
    return query.get("schema", "public")


def _server_url(url: str) -> str:
    """``url`` without prismd's own query options (asyncpg does not know them)."""
    return urllib.parse.urlunsplit(urllib.parse.urlsplit(url)._replace(query=""))


class HostDb:
    """The host's own connection (not prismd's pool), on a trio-asyncio loop."""

    def __init__(self, loop: Any, conn: Any) -> None:
        self._loop = loop
        self._conn = conn

    async def fetch(self, sql: str, *args: Any) -> list[Any]:
        return list(await self._loop.run_aio_coroutine(self._conn.fetch(sql, *args)))

    async def execute(self, sql: str, *args: Any) -> None:
        await self._loop.run_aio_coroutine(self._conn.execute(sql, *args))

    async def in_transaction(self, statements: Callable[[HostDb], Awaitable[Any]]) -> Any:
        """``BEGIN`` → ``statements`` → ``COMMIT`` (``ROLLBACK`` when they raise)."""
        await self.execute("BEGIN")
        try:
            result = await statements(self)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self.execute("ROLLBACK")
            raise
        await self.execute("COMMIT")
        return result


@contextlib.asynccontextmanager
async def open_host_db(url: str) -> AsyncIterator[HostDb]:
    import asyncpg
    import trio_asyncio

    async with trio_asyncio.open_loop() as loop:
        conn = await loop.run_aio_coroutine(asyncpg.connect(_server_url(url)))
        try:
            yield HostDb(loop, conn)
        finally:
            with trio.CancelScope(shield=True):
                await loop.run_aio_coroutine(conn.close())


@attrs.define(eq=False)
class OutboxHost:
    """``deliver`` for the runtime and ``redrive`` for the outbox, on the host's tables."""

    db: HostDb
    schema: str
    send: Send
    crash_after_commit: bool = False

    @property
    def _s(self) -> str:
        return '"' + self.schema.replace('"', '""') + '"'

    async def create_tables(self) -> None:
        s = self._s
        await self.db.execute(f"CREATE SCHEMA IF NOT EXISTS {s}")
        await self.db.execute(
            f"CREATE TABLE IF NOT EXISTS {s}.desk_tickets ("
            " tenant_id text NOT NULL, conversation_id text NOT NULL,"
            " status text NOT NULL, replies integer NOT NULL DEFAULT 0,"
            " PRIMARY KEY (tenant_id, conversation_id))"
        )
        await self.db.execute(
            f"CREATE TABLE IF NOT EXISTS {s}.desk_replies ("
            " tenant_id text NOT NULL, message_id text NOT NULL,"
            " conversation_id text NOT NULL, thread_id text, body text NOT NULL,"
            " PRIMARY KEY (tenant_id, message_id))"
        )
        await self.db.execute(
            f"CREATE TABLE IF NOT EXISTS {s}.desk_outbox ("
            " tenant_id text NOT NULL, message_id text NOT NULL, payload jsonb NOT NULL,"
            " created_at timestamptz NOT NULL DEFAULT now(), claimed_until timestamptz,"
            " attempts integer NOT NULL DEFAULT 0, sent_at timestamptz, sent_id text,"
            " PRIMARY KEY (tenant_id, message_id))"
        )

    async def deliver(self, reply: Reply) -> SendResult:
        """The runtime's ``deliver``: commit the business change and the outbox row, then
        send (the row's own send path, so a reply is sent once whichever path gets it)."""
        if reply.operation_id is None:
            return SendResult(delivered=False, reason="no operation to key the outbox on")
        tenant = TENANT  # the grant's tenant: the resolved identity's ownership scope
        payload = {
            "connectionId": reply.connection_id,
            "eventId": reply.in_reply_to,
            "operationId": reply.operation_id,
            "kind": reply.kind,
        }
        s = self._s

        async def record(db: HostDb) -> bool:
            appended = await db.fetch(
                f"INSERT INTO {s}.desk_outbox (tenant_id, message_id, payload)"
                " VALUES ($1, $2, $3::jsonb) ON CONFLICT (tenant_id, message_id) DO NOTHING"
                " RETURNING 1",
                tenant, reply.operation_id, json.dumps(payload),
            )  # fmt: skip
            if not appended:
                return False  # a repeated deliver: the business change was made already
            await db.execute(
                f"INSERT INTO {s}.desk_replies VALUES ($1, $2, $3, $4, $5)",
                tenant, reply.operation_id, reply.external_conversation_id, reply.thread_id,
                reply.text,
            )  # fmt: skip
            await db.execute(
                f"INSERT INTO {s}.desk_tickets AS t VALUES ($1, $2, 'answered', 1)"
                " ON CONFLICT (tenant_id, conversation_id)"
                " DO UPDATE SET status = 'answered', replies = t.replies + 1",
                tenant, reply.external_conversation_id,
            )  # fmt: skip
            return True

        await self.db.in_transaction(record)
        if self.crash_after_commit:
            os._exit(CRASH_EXIT)  # committed, never sent: --redrive sends it
        return await self._send_row(tenant, reply.operation_id)

    async def redrive(self) -> int:
        """Send every unsent row nobody holds; how many were sent."""
        rows = await self.db.fetch(
            f"SELECT tenant_id, message_id FROM {self._s}.desk_outbox"
            " WHERE sent_at IS NULL AND (claimed_until IS NULL OR claimed_until < now())"
            " ORDER BY created_at LIMIT $1",
            REDRIVE_BATCH,
        )
        sent = 0
        for tenant, message_id in rows:
            sent += (await self._send_row(tenant, message_id)).delivered
        return sent

    async def _send_row(self, tenant: str, message_id: str) -> SendResult:
        s = self._s
        claimed = await self.db.fetch(
            f"UPDATE {s}.desk_outbox SET claimed_until = now() + make_interval(secs => $3),"
            " attempts = attempts + 1"
            f" WHERE (tenant_id, message_id) IN (SELECT tenant_id, message_id FROM {s}.desk_outbox"
            "   WHERE tenant_id = $1 AND message_id = $2 AND sent_at IS NULL"
            "     AND (claimed_until IS NULL OR claimed_until < now())"
            "   FOR UPDATE SKIP LOCKED)"
            " RETURNING payload",
            tenant, message_id, CLAIM_TTL_S,
        )  # fmt: skip
        if not claimed:
            done = await self.db.fetch(
                f"SELECT sent_id FROM {s}.desk_outbox"
                " WHERE tenant_id = $1 AND message_id = $2 AND sent_at IS NOT NULL",
                tenant, message_id,
            )  # fmt: skip
            if done:
                return SendResult(delivered=True, message_id=done[0][0])
            return SendResult(delivered=False, reason="another sender holds the outbox row")
        payload: Mapping[str, Any] = json.loads(claimed[0][0])
        (conversation, thread, body), *_ = await self.db.fetch(
            f"SELECT conversation_id, thread_id, body FROM {s}.desk_replies"
            " WHERE tenant_id = $1 AND message_id = $2",
            tenant, message_id,
        )  # fmt: skip
        result = await self.send(
            Reply(
                connection_id=payload["connectionId"],
                external_conversation_id=conversation,
                text=body,
                kind=payload["kind"],
                thread_id=thread,
                in_reply_to=payload["eventId"],
                operation_id=message_id,
            )
        )
        if result.delivered:
            await self.db.execute(
                f"UPDATE {s}.desk_outbox SET sent_at = now(), sent_id = $3, claimed_until = NULL"
                " WHERE tenant_id = $1 AND message_id = $2",
                tenant, message_id, result.message_id,
            )  # fmt: skip
        else:  # refused: nothing went out, the row may be sent again
            await self.db.execute(
                f"UPDATE {s}.desk_outbox SET claimed_until = NULL"
                " WHERE tenant_id = $1 AND message_id = $2",
                tenant, message_id,
            )  # fmt: skip
        return result

    async def row(self, message_id: str) -> dict[str, Any] | None:
        rows = await self.db.fetch(
            f"SELECT payload, attempts, sent_at IS NOT NULL FROM {self._s}.desk_outbox"
            " WHERE tenant_id = $1 AND message_id = $2",
            TENANT, message_id,
        )  # fmt: skip
        if not rows:
            return None
        payload, attempts, sent = rows[0]
        return {"payload": json.loads(payload), "attempts": attempts, "sent": sent}


async def _main(args: argparse.Namespace) -> int:
    token = os.environ.get("TELEGRAM_TOKEN", "")
    if not token:
        print("messaging_outbox: set TELEGRAM_TOKEN", file=sys.stderr)
        return 2
    async with open_store(args.store) as store, open_host_db(args.store) as db:
        telegram = TelegramAdapter(
            connection_id=CONNECTION,
            token=lambda: token,
            admit=_not_receiving,
            store=store,
            owner_id="outbox-example",
            api_origin=args.telegram_origin,
            lease_ttl_ms=60_000,
        )
        host = OutboxHost(
            db=db,
            schema=_schema_of(args.store),
            send=telegram.send,
            crash_after_commit=args.crash_after_commit,
        )
        try:
            await host.create_tables()
            if args.redrive:
                print(json.dumps({"redriven": await host.redrive()}))
                return 0
            agent = build_agent(
                ALIAS, AgentContext(alias=ALIAS, options={}, checkpoints=store.checkpoints)
            )

            async def resolve_agent(_request: Any) -> Any:
                return agent

            async with open_messaging_runtime(
                authorize=GrantAuthorizer([GRANT]).authorize,
                resolve_agent=resolve_agent,
                deliver=host.deliver,
                store=store,
                owner_id=f"outbox-example-{os.getpid()}-{time.time_ns()}",
            ) as runtime:
                admission = await runtime.admit(
                    InboundEvent(
                        connection_id=CONNECTION,
                        external_conversation_id=args.chat,
                        external_actor_id=args.chat,
                        event_id=args.event_id,
                        text=args.text,
                    )
                )
                await runtime.drain(deadline_ms=10_000)
                await runtime.stop()
            row = None if admission.operation_id is None else await host.row(admission.operation_id)
            print(
                json.dumps(
                    {
                        "status": admission.status,
                        "duplicate": admission.duplicate,
                        "operationId": admission.operation_id,
                        "outbox": row,
                    }
                )
            )
            return 0 if admission.status == "accepted" else 1
        finally:
            await telegram.aclose()


async def _not_receiving(_event: InboundEvent) -> Any:
    raise AssertionError("this example admits through the runtime, not through the adapter")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--store", required=True, help="postgresql:// URL (?schema=…)")
    parser.add_argument("--telegram-origin", required=True, help="the Bot API origin")
    parser.add_argument("--redrive", action="store_true", help="send the unsent outbox rows")
    parser.add_argument("--chat", default="101", help="the chat the message comes from")
    parser.add_argument("--event-id", default="1", help="its update id")
    parser.add_argument("--text", default="hello", help="its text")
    parser.add_argument(
        "--crash-after-commit", action="store_true", help="exit 3 after COMMIT, before send"
    )
    return trio.run(_main, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
