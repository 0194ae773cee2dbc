"""The PostgreSQL schema: embedded, versioned, forward-only migrations.

Every migration is SQL with ``@S@`` standing for the quoted schema name, so every table and
function is schema-qualified and no statement depends on the session's ``search_path``. A
migration, once released, never changes: the next change is a new migration (the checksum of
each applied one is recorded and checked at every start).

:func:`migrate` runs in one transaction under a transaction-level advisory lock keyed by the
schema, so any number of instances starting together against an empty database apply each
migration exactly once: the first applies, the others wait for its commit and find nothing
left to do. A database whose schema is newer than this build, or whose recorded migrations do
not match the embedded ones, is refused with :class:`~stores.StoreUnavailableError`.

Tables (the contract's ``prism_checkpoints``/``prism_leases``, the event stream, the inbox):

* ``prism_checkpoints`` — ``(namespace, key)`` primary key, ``COLLATE "C"`` so listing order
  is code-point order as on the other backends; values and metadata are ``json`` (the exact
  text prismd wrote, ``\\u0000`` included, which ``jsonb`` would refuse); times are integer
  milliseconds from the store's clock.
* ``prism_leases`` — never deleted, so fencing counters survive release and expiry.
* ``prism_events`` + ``prism_event_seq`` — the journal's events; ``seq`` comes from the single
  ``prism_event_seq`` row, updated by the writing transaction as its last statement. Its row
  lock is held until commit, so event-writing transactions commit one after another in ``seq``
  order and become visible in that order: a reader can never see ``seq`` N+1 while N is still
  to come, and an aborted transaction gives its numbers back (no gaps at all).
* ``prism_inbox`` (migration 2) — :class:`~stores.InboxStore`'s items, ``(source, key)``
  primary key (the dedup).
* ``prism_polls`` (migration 3) — :class:`~stores.PollStore`'s due polls, ``key`` primary
  key; a row lives while its remote task is followed.
* ``prism_schema_migrations`` — what was applied, when, with which checksum.

Functions (so a group commit or a lease call is one round trip, see :mod:`stores.postgres._writer`):

* ``prism_apply_write`` — one save or delete with every check in its writing statement.
* ``prism_write_checkpoints`` — a batch of jobs; an atomic job of several writes runs in a
  subtransaction that is rolled back when one of them loses its check.
* ``prism_acquire_lease`` / ``prism_move_lease`` — acquisition by ``INSERT … ON CONFLICT DO
  UPDATE … WHERE expired`` (the conflicting row is locked, so two instances racing for one
  lease get one winner), renewal and release by ``UPDATE … WHERE owner AND token AND
  unexpired``; a miss says whether the row belongs to another scope.
"""

from __future__ import annotations

import hashlib
import re
import textwrap

import attrs

from .._types import SchemaStatus, StoreUnavailableError
from ._driver import Session


@attrs.frozen
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode("utf-8")).hexdigest()[:16]


# Part of migration 1's text (and so of its checksum): never edit, add a migration instead.
_SCOPE_EQ = (
    "c.tenant_id IS NOT DISTINCT FROM p_tenant AND c.account_id IS NOT DISTINCT FROM p_account"
    " AND c.user_id IS NOT DISTINCT FROM p_user"
)

# Part of migration 1's text too: the writes of one job, each through prism_apply_write, the
# written ones noted for their events. Written once, it stands in both branches of
# prism_write_checkpoints (in a subtransaction for an atomic job, bare otherwise).
_APPLY_JOB = """\
FOR j IN i..last_write LOOP
    SELECT * INTO r FROM @S@.prism_apply_write(
        p_now[j], p_delete[j], p_namespace[j], p_key[j], p_tenant[j],
        p_account[j], p_user[j], p_version[j], p_expected[j], p_fence[j],
        p_category[j], p_value[j], p_metadata[j]);
    st[j] := r.o_status;
    ca[j] := r.o_created;
    ua[j] := r.o_updated;
    IF r.o_status = 'ok' THEN
        ev_write := ev_write || j;
        ev_version := ev_version || r.o_version;
        ev_category := ev_category || r.o_category;
    END IF;
END LOOP;
"""

# And this: how a lease function ends, given the word for "held by another" ('busy' for an
# acquire, 'lost' for a renew or release): 'ok' when its row was written, else 'scope' when
# the lease is another scope's, else that word.
_LEASE_OUTCOME = """\
RETURNING c.fencing_token, c.acquired_at, c.expires_at INTO o_fence, o_acquired, o_expires;
IF FOUND THEN
    o_status := 'ok';
    RETURN;
END IF;
SELECT CASE WHEN @SCOPE@ THEN '@MISS@' ELSE 'scope' END INTO o_status
  FROM @S@.prism_leases AS c WHERE c.namespace = p_namespace AND c.key = p_key;
o_status := coalesce(o_status, '@MISS@');
"""


def _fill(sql: str) -> str:
    """Migration 1's text: each line ``@APPLY_JOB@`` or ``@LEASE_OUTCOME:<word>@`` replaced
    by its piece at that line's indent, then ``@SCOPE@`` by :data:`_SCOPE_EQ`."""

    def piece(line: re.Match[str]) -> str:
        indent, name, word = line.groups()
        text = _APPLY_JOB if name == "APPLY_JOB" else _LEASE_OUTCOME.replace("@MISS@", word)
        return textwrap.indent(text, indent)

    sql = re.sub(r"^( *)@(APPLY_JOB|LEASE_OUTCOME):?(\w*)@\n", piece, sql, flags=re.MULTILINE)
    return sql.replace("@SCOPE@", _SCOPE_EQ)


_V1 = """
CREATE TABLE @S@.prism_checkpoints (
    namespace     text COLLATE "C" NOT NULL,
    key           text COLLATE "C" NOT NULL,
    version       bigint NOT NULL,
    fencing_token bigint,
    category      text COLLATE "C",
    tenant_id     text COLLATE "C",
    account_id    text COLLATE "C",
    user_id       text COLLATE "C",
    value         json NOT NULL,
    metadata      json,
    created_at    bigint NOT NULL,
    updated_at    bigint NOT NULL,
    PRIMARY KEY (namespace, key)
);
CREATE INDEX prism_checkpoints_list
    ON @S@.prism_checkpoints (namespace, category, tenant_id, updated_at DESC, key);
CREATE INDEX prism_checkpoints_recent
    ON @S@.prism_checkpoints (updated_at DESC, key, namespace);

CREATE TABLE @S@.prism_leases (
    namespace     text COLLATE "C" NOT NULL,
    key           text COLLATE "C" NOT NULL,
    tenant_id     text COLLATE "C",
    account_id    text COLLATE "C",
    user_id       text COLLATE "C",
    owner_id      text COLLATE "C" NOT NULL,
    token         text COLLATE "C" NOT NULL,
    fencing_token bigint NOT NULL,
    acquired_at   bigint NOT NULL,
    expires_at    bigint NOT NULL,
    updated_at    bigint NOT NULL,
    PRIMARY KEY (namespace, key)
);

CREATE TABLE @S@.prism_event_seq (
    id       integer PRIMARY KEY CHECK (id = 1),
    last_seq bigint NOT NULL
);
INSERT INTO @S@.prism_event_seq (id, last_seq) VALUES (1, 0);

CREATE TABLE @S@.prism_events (
    seq        bigint PRIMARY KEY,
    at         bigint NOT NULL,
    action     text NOT NULL,
    namespace  text COLLATE "C" NOT NULL,
    key        text COLLATE "C" NOT NULL,
    tenant_id  text COLLATE "C",
    account_id text COLLATE "C",
    user_id    text COLLATE "C",
    version    bigint,
    category   text COLLATE "C",
    metadata   json
);

CREATE FUNCTION @S@.prism_apply_write(
    p_now bigint, p_delete boolean, p_namespace text, p_key text,
    p_tenant text, p_account text, p_user text, p_version bigint, p_expected bigint,
    p_fence bigint, p_category text, p_value text, p_metadata text,
    OUT o_status text, OUT o_created bigint, OUT o_updated bigint,
    OUT o_version bigint, OUT o_category text
) LANGUAGE plpgsql AS $fn$
BEGIN
    IF p_delete THEN
        DELETE FROM @S@.prism_checkpoints AS c
         WHERE c.namespace = p_namespace AND c.key = p_key AND @SCOPE@
        RETURNING c.version, c.category INTO o_version, o_category;
        o_status := CASE WHEN FOUND THEN 'ok' ELSE 'missing' END;
        RETURN;
    END IF;
    IF p_expected = 0 THEN
        INSERT INTO @S@.prism_checkpoints AS c
            (namespace, key, version, fencing_token, category, tenant_id, account_id,
             user_id, value, metadata, created_at, updated_at)
        VALUES (p_namespace, p_key, p_version, p_fence, p_category, p_tenant, p_account,
                p_user, p_value::json, p_metadata::json, p_now, p_now)
        ON CONFLICT (namespace, key) DO NOTHING
        RETURNING c.created_at, c.updated_at INTO o_created, o_updated;
    ELSIF p_expected IS NULL THEN
        INSERT INTO @S@.prism_checkpoints AS c
            (namespace, key, version, fencing_token, category, tenant_id, account_id,
             user_id, value, metadata, created_at, updated_at)
        VALUES (p_namespace, p_key, p_version, p_fence, p_category, p_tenant, p_account,
                p_user, p_value::json, p_metadata::json, p_now, p_now)
        ON CONFLICT (namespace, key) DO UPDATE SET
            version = excluded.version, fencing_token = excluded.fencing_token,
            category = excluded.category, value = excluded.value,
            metadata = excluded.metadata, updated_at = greatest(excluded.updated_at, c.updated_at)
        WHERE @SCOPE@ AND excluded.version > c.version
          AND (c.fencing_token IS NULL OR excluded.fencing_token >= c.fencing_token)
        RETURNING c.created_at, c.updated_at INTO o_created, o_updated;
    ELSE
        -- A positive expected version needs the row: a plain UPDATE, re-checked by the
        -- server against the newest committed row once any concurrent writer is done.
        UPDATE @S@.prism_checkpoints AS c SET
            version = p_version, fencing_token = p_fence, category = p_category,
            value = p_value::json, metadata = p_metadata::json,
            updated_at = greatest(p_now, c.updated_at)
         WHERE c.namespace = p_namespace AND c.key = p_key AND @SCOPE@
           AND c.version = p_expected AND p_version > c.version
           AND (c.fencing_token IS NULL OR p_fence >= c.fencing_token)
        RETURNING c.created_at, c.updated_at INTO o_created, o_updated;
    END IF;
    IF FOUND THEN
        o_status := 'ok';
        o_version := p_version;
        o_category := p_category;
    ELSE
        o_status := 'conflict';
    END IF;
END
$fn$;

CREATE FUNCTION @S@.prism_write_checkpoints(
    p_job integer[], p_atomic boolean[], p_now bigint[], p_delete boolean[],
    p_namespace text[], p_key text[], p_tenant text[], p_account text[], p_user text[],
    p_version bigint[], p_expected bigint[], p_fence bigint[], p_category text[],
    p_value text[], p_metadata text[]
) RETURNS TABLE (o_status text, o_created bigint, o_updated bigint)
LANGUAGE plpgsql AS $fn$
DECLARE
    n integer := coalesce(cardinality(p_job), 0);
    st text[] := array_fill(NULL::text, ARRAY[n]);
    ca bigint[] := array_fill(NULL::bigint, ARRAY[n]);
    ua bigint[] := array_fill(NULL::bigint, ARRAY[n]);
    ev_write integer[] := '{}';
    ev_version bigint[] := '{}';
    ev_category text[] := '{}';
    i integer := 1;
    j integer;
    last_write integer;
    mark integer;
    events integer;
    top bigint;
    r record;
BEGIN
    WHILE i <= n LOOP
        last_write := i;
        WHILE last_write < n AND p_job[last_write + 1] = p_job[i] LOOP
            last_write := last_write + 1;
        END LOOP;
        IF p_atomic[i] AND last_write > i THEN
            -- All or nothing: the job runs in a subtransaction, undone when a write loses.
            mark := cardinality(ev_write);
            BEGIN
                @APPLY_JOB@
                IF EXISTS (SELECT 1 FROM unnest(st[i:last_write]) AS x(s) WHERE x.s <> 'ok') THEN
                    RAISE EXCEPTION USING ERRCODE = 'PR001';
                END IF;
            EXCEPTION WHEN SQLSTATE 'PR001' THEN
                FOR j IN i..last_write LOOP
                    IF st[j] = 'ok' THEN
                        st[j] := 'aborted';
                        ca[j] := NULL;
                        ua[j] := NULL;
                    END IF;
                END LOOP;
                ev_write := ev_write[1:mark];
                ev_version := ev_version[1:mark];
                ev_category := ev_category[1:mark];
            END;
        ELSE
            -- No subtransaction: a lost check writes nothing by itself.
            @APPLY_JOB@
        END IF;
        i := last_write + 1;
    END LOOP;
    events := cardinality(ev_write);
    IF events > 0 THEN
        -- Last, and held to COMMIT: event-writing transactions commit in seq order.
        UPDATE @S@.prism_event_seq SET last_seq = last_seq + events WHERE id = 1
        RETURNING last_seq INTO top;
        INSERT INTO @S@.prism_events
            (seq, at, action, namespace, key, tenant_id, account_id, user_id, version,
             category, metadata)
        SELECT top - events + e.ord, p_now[e.w],
               CASE WHEN p_delete[e.w] THEN 'delete' ELSE 'save' END,
               p_namespace[e.w], p_key[e.w], p_tenant[e.w], p_account[e.w], p_user[e.w],
               e.v, e.c, CASE WHEN p_delete[e.w] THEN NULL ELSE p_metadata[e.w]::json END
          FROM unnest(ev_write, ev_version, ev_category) WITH ORDINALITY AS e(w, v, c, ord);
    END IF;
    RETURN QUERY SELECT x.a, x.b, x.c
      FROM unnest(st, ca, ua) WITH ORDINALITY AS x(a, b, c, ord) ORDER BY x.ord;
END
$fn$;

CREATE FUNCTION @S@.prism_acquire_lease(
    p_namespace text, p_key text, p_tenant text, p_account text, p_user text,
    p_owner text, p_token text, p_now bigint, p_expires bigint, p_reclaim boolean,
    OUT o_status text, OUT o_fence bigint, OUT o_acquired bigint, OUT o_expires bigint
) LANGUAGE plpgsql AS $fn$
BEGIN
    INSERT INTO @S@.prism_leases AS c
        (namespace, key, tenant_id, account_id, user_id, owner_id, token, fencing_token,
         acquired_at, expires_at, updated_at)
    VALUES (p_namespace, p_key, p_tenant, p_account, p_user, p_owner, p_token, 1,
            p_now, p_expires, p_now)
    ON CONFLICT (namespace, key) DO UPDATE SET
        owner_id = excluded.owner_id, token = excluded.token,
        fencing_token = c.fencing_token + 1, acquired_at = excluded.acquired_at,
        expires_at = excluded.expires_at, updated_at = excluded.updated_at
    WHERE @SCOPE@ AND (c.expires_at <= p_now OR (p_reclaim AND c.owner_id = p_owner))
    @LEASE_OUTCOME:busy@
END
$fn$;

CREATE FUNCTION @S@.prism_move_lease(
    p_namespace text, p_key text, p_tenant text, p_account text, p_user text,
    p_owner text, p_token text, p_now bigint, p_expires bigint,
    OUT o_status text, OUT o_fence bigint, OUT o_acquired bigint, OUT o_expires bigint
) LANGUAGE plpgsql AS $fn$
BEGIN
    UPDATE @S@.prism_leases AS c SET expires_at = p_expires, updated_at = p_now
     WHERE c.namespace = p_namespace AND c.key = p_key AND @SCOPE@
       AND c.owner_id = p_owner AND c.token = p_token AND c.expires_at > p_now
    @LEASE_OUTCOME:lost@
END
$fn$;
"""
_V1 = _fill(_V1)

# Migration 2: the durable inbox (InboxStore). Claims are one UPDATE over a
# ``FOR UPDATE SKIP LOCKED`` selection (see stores.postgres._inbox); the indexes serve the
# readiness rules: due items by state, a partition's unfinished head, its holds, pruning.
_V2 = """
CREATE TABLE @S@.prism_inbox (
    source           text COLLATE "C" NOT NULL,
    key              text COLLATE "C" NOT NULL,
    partition        text COLLATE "C" NOT NULL,
    ord              bigint NOT NULL,
    payload          json,
    state            text COLLATE "C" NOT NULL,
    attempts         integer NOT NULL,
    available_at     bigint NOT NULL,
    owner_id         text COLLATE "C",
    token            text COLLATE "C",
    claim_expires_at bigint NOT NULL,
    error            text,
    created_at       bigint NOT NULL,
    updated_at       bigint NOT NULL,
    PRIMARY KEY (source, key)
);
CREATE INDEX prism_inbox_ready ON @S@.prism_inbox (state, available_at);
CREATE INDEX prism_inbox_head ON @S@.prism_inbox (source, partition, state, ord, key);
CREATE INDEX prism_inbox_hold ON @S@.prism_inbox (source, partition, claim_expires_at);
CREATE INDEX prism_inbox_prune ON @S@.prism_inbox (state, updated_at);
"""

# Migration 3: due polls (PollStore): one row per followed remote task, reserved one
# instance at a time ``FOR UPDATE SKIP LOCKED`` (see stores.postgres._polls).
_V3 = """
CREATE TABLE @S@.prism_polls (
    key        text COLLATE "C" PRIMARY KEY,
    due_at     bigint NOT NULL,
    owner_id   text COLLATE "C",
    fence      bigint NOT NULL,
    expires_at bigint NOT NULL
);
"""

MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "checkpoints, leases, events", _V1),
    Migration(2, "inbox", _V2),
    Migration(3, "polls", _V3),
)
"""Append only: a released migration is never edited (its checksum is checked)."""

LATEST = MIGRATIONS[-1].version


def quote_ident(name: str) -> str:
    """``name`` as a quoted SQL identifier (the URL parser already allows only [a-z0-9_])."""
    return '"' + name.replace('"', '""') + '"'


def render(sql: str, schema: str) -> str:
    return sql.replace("@S@", quote_ident(schema))


_LOCK_CLASS = 0x70726973  # "pris": with hashtext(schema), the advisory lock of one schema


async def _recorded(session: Session, schema: str) -> dict[int, str] | None:
    """Applied version → checksum, or ``None`` when the migrations table does not exist."""
    table = f"{quote_ident(schema)}.prism_schema_migrations"
    exists = await session.fetchrow("SELECT to_regclass($1) IS NOT NULL", table)
    if exists is None or not exists[0]:
        return None
    rows = await session.fetch(f"SELECT version, checksum FROM {table} ORDER BY version")
    return {int(v): str(c) for v, c in rows}


def _check(recorded: dict[int, str], schema: str, where: str) -> int:
    """The current version; refuses a newer schema and a history that is not ours."""
    current = max(recorded, default=0)
    if current > LATEST:
        raise StoreUnavailableError(
            f"PostgreSQL store {where}: schema {schema} is at version {current}, newer than"
            f" this prismd knows ({LATEST}): upgrade prismd, or point it at another schema"
        )
    known = {m.version: m for m in MIGRATIONS}
    for version, checksum in recorded.items():
        if version not in known or known[version].checksum != checksum:
            raise StoreUnavailableError(
                f"PostgreSQL store {where}: schema {schema} records migration {version}"
                " differently from this build: it was migrated by another prismd"
            )
    missing = [v for v in range(1, current + 1) if v not in recorded]
    if missing:
        raise StoreUnavailableError(
            f"PostgreSQL store {where}: schema {schema} lacks migration {missing[0]}"
        )
    return current


async def status(session: Session, schema: str, where: str) -> SchemaStatus:
    """Read the state without changing anything (``prismd migrate --check``)."""
    recorded = await _recorded(session, schema)
    return SchemaStatus(schema=schema, current=_check(recorded or {}, schema, where), latest=LATEST)


async def migrate(session: Session, schema: str, where: str) -> SchemaStatus:
    """Apply what is missing, in one transaction under the schema's advisory lock."""
    quoted = quote_ident(schema)
    async with session.transaction():
        await session.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", _LOCK_CLASS, schema)
        # CREATE … IF NOT EXISTS still needs the privilege: ask first, so a role that may
        # only use an existing schema still starts.
        found = await session.fetchrow("SELECT 1 FROM pg_namespace WHERE nspname = $1", schema)
        if found is None:
            await session.execute(f"CREATE SCHEMA {quoted}")
        recorded = await _recorded(session, schema)
        if recorded is None:
            await session.execute(
                f"CREATE TABLE {quoted}.prism_schema_migrations ("
                " version integer PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            recorded = {}
        current = _check(recorded, schema, where)
        applied: list[int] = []
        for migration in MIGRATIONS:
            if migration.version <= current:
                continue
            await session.execute(render(migration.sql, schema))
            await session.execute(
                f"INSERT INTO {quoted}.prism_schema_migrations (version, name, checksum)"
                " VALUES ($1, $2, $3)",
                migration.version,
                migration.name,
                migration.checksum,
            )
            applied.append(migration.version)
    return SchemaStatus(
        schema=schema, current=max([current, *applied]), latest=LATEST, applied=tuple(applied)
    )
