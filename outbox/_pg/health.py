"""The SQL of table health: the toolkit's tables' statistics and the xmin horizon's oldest holder.

Invariant: reads PostgreSQL's statistics only, through the functions its statistics views are
made of (``pg_stat_get_live_tuples``, ``pg_stat_get_activity``, ...): the same answers, without
the views' joins and the columns nobody reads, about a third of the backend's work (a fleet's
relays read them for every database they serve). A role without ``pg_read_all_stats`` (or
``pg_monitor``) sees other roles' sessions without their transaction ids and start times, so
it cannot name them: grant it to the role that runs ``outbox status`` and the relays.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from outbox._core.health import HorizonHolder, TableHealth
from outbox.schema import CACHE_SECRET, IDEMPOTENCY_KEYS, OUTBOX

TOOLKIT_TABLES = (IDEMPOTENCY_KEYS, OUTBOX, CACHE_SECRET)

TABLE_HEALTH = sa.text(
    """
SELECT c.relname AS name,
       coalesce(pg_stat_get_live_tuples(c.oid), 0) AS live,
       coalesce(pg_stat_get_dead_tuples(c.oid), 0) AS dead,
       pg_total_relation_size(c.oid) AS size,
       greatest(pg_stat_get_last_vacuum_time(c.oid),
                pg_stat_get_last_autovacuum_time(c.oid)) AS last_vacuum,
       pg_stat_get_last_autovacuum_time(c.oid) AS last_autovacuum
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = coalesce(CAST(:schema AS text), current_schema())
  AND c.relname = ANY(CAST(:names AS text[]))
  AND c.relkind IN ('r', 'p')
ORDER BY c.relname
"""
)

# Sessions of this database (and those of none: WAL senders of standbys with
# hot_standby_feedback, which pg_stat_activity shows without a datname), prepared transactions
# of this database, and replication slots; the session asking is left out. Never the query text.
HORIZON_HOLDER = sa.text(
    """
SELECT kind, xid_age, age_seconds, pid, application_name, state, started, name
FROM (
    SELECT 'transaction' AS kind,
           greatest(age(a.backend_xid), age(a.backend_xmin)) AS xid_age,
           EXTRACT(EPOCH FROM now() - a.xact_start)::float8 AS age_seconds,
           a.pid, a.application_name, a.state, a.xact_start AS started, NULL::text AS name
    FROM pg_stat_get_activity(NULL) a
    WHERE (a.backend_xid IS NOT NULL OR a.backend_xmin IS NOT NULL)
      AND a.pid <> pg_backend_pid()
      AND (a.datid = (SELECT oid FROM pg_database WHERE datname = current_database())
           OR NOT EXISTS (SELECT 1 FROM pg_database d WHERE d.oid = a.datid))
    UNION ALL
    SELECT 'prepared transaction', age(p.transaction),
           EXTRACT(EPOCH FROM now() - p.prepared)::float8,
           NULL, NULL, NULL, p.prepared, p.gid
    FROM pg_prepared_xacts p
    WHERE p.database = current_database()
    UNION ALL
    SELECT 'replication slot', age(s.xmin), NULL, s.active_pid, NULL,
           CASE WHEN s.active THEN 'active' ELSE 'inactive' END, NULL, s.slot_name::text
    FROM pg_replication_slots s
    WHERE s.xmin IS NOT NULL
) h
ORDER BY xid_age DESC NULLS LAST, age_seconds DESC NULLS LAST
LIMIT 1
"""
)


def table_health(
    connection: sa.Connection, schema: str | None, names: Sequence[str] = TOOLKIT_TABLES
) -> list[TableHealth]:
    """Statistics of the toolkit's tables in ``schema`` (``schema`` passed the allow-list)."""
    rows = connection.execute(TABLE_HEALTH, {"schema": schema, "names": list(names)})
    return [
        TableHealth(r.name, int(r.live), int(r.dead), int(r.size), r.last_vacuum, r.last_autovacuum)
        for r in rows
    ]


def horizon_holder(connection: sa.Connection) -> HorizonHolder | None:
    """The oldest holder of the xmin horizon that this role can see, if any."""
    r = connection.execute(HORIZON_HOLDER).first()
    if r is None or r.xid_age is None:
        return None
    return HorizonHolder(
        kind=r.kind,
        xid_age=int(r.xid_age),
        age_seconds=None if r.age_seconds is None else float(r.age_seconds),
        pid=r.pid,
        application_name=r.application_name,
        state=r.state,
        started=r.started,
        name=r.name,
    )
