"""A database that may have lost commits never trusts what Redis kept of its predecessor.

Both tests run private clusters (``tests/fixtures/pg_cluster.py``). A dump restored into a
fresh cluster gets the same OIDs each time and carries the cache's secret; a promoted standby
has the same OIDs, secret and system identifier as its primary. What tells them apart is the
cluster's system identifier (another ``initdb``) and the timeline (a promotion starts a new
one): a retry of a key the database does not hold runs its body, it is not replayed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
import sqlalchemy as sa

import outbox
from outbox import OutboxConfig
from tests.fixtures.pg_cluster import Clusters
from tests.fixtures.uow import count, create_orders, place

_IDENTITY = (
    "SELECT d.oid AS database_oid, to_regclass('idempotency_keys')::oid AS keys_oid, "
    "(SELECT system_identifier FROM pg_control_system()) AS system_identifier, "
    "substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) AS timeline "
    "FROM pg_database AS d WHERE d.datname = current_database()"
)


def _url(port: int, name: str = "shop") -> str:
    return f"postgresql+psycopg://postgres@127.0.0.1:{port}/{name}"


def _identity(port: int) -> sa.Row[tuple[int, int, int, str]]:
    engine = sa.create_engine(_url(port), poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text(_IDENTITY)).one()
    finally:
        engine.dispose()


@contextmanager
def _outbox(port: int, redis_url: str, prefix: str) -> Iterator[outbox.Outbox]:
    engine = sa.create_engine(_url(port))
    create_orders(engine)
    client = redis.Redis.from_url(redis_url)
    ob = outbox.Outbox(engine, redis=client, config=OutboxConfig(cache_prefix=prefix))
    try:
        yield ob
    finally:
        ob.close()
        engine.dispose()
        client.close()


def _dump(clusters: Clusters, port: int, name: str, into: str) -> Path:
    path = clusters.root / into
    clusters.run("pg_dump", "-Fc", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres",
                 "-d", name, "-f", str(path))  # fmt: skip
    return path


def _restore(clusters: Clusters, port: int, dump: Path) -> None:
    address = ["-h", "127.0.0.1", "-p", str(port), "-U", "postgres"]
    clusters.run("createdb", *address, "shop")
    clusters.run("pg_restore", *address, "-d", "shop", "--exit-on-error", str(dump))


def _fresh_clusters(clusters: Clusters, *names: str) -> list[int]:
    """``initdb`` and start clusters side by side (each ``initdb`` takes a while); ports."""
    datadirs: dict[str, Path] = {}

    def make(name: str) -> None:
        datadirs[name] = clusters.initdb(name)

    threads = [threading.Thread(target=make, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(datadirs) == set(names), "an initdb failed (see its error above)"
    return [clusters.start(datadirs[name]) for name in names]


def test_a_dump_restored_into_a_fresh_cluster_runs_keys_it_does_not_hold(
    clusters: Clusters, database_url: str, redis_url: str, redis_prefix: str
) -> None:
    main = sa.engine.make_url(database_url)
    assert main.database is not None
    seed = _dump(clusters, main.port or 5432, main.database, "seed.dump")  # migrated, empty
    first, second = _fresh_clusters(clusters, "first", "second")
    # A database that lives in a cluster it was restored into...
    _restore(clusters, first, seed)
    with _outbox(first, redis_url, redis_prefix) as ob:
        create_orders(ob.engine)
        nightly = _dump(clusters, first, "shop", "nightly.dump")
        # ...commits a key after the nightly dump; Redis remembers it.
        assert place(ob, "after-dump") == (False, {"order": "after-dump"})
        assert place(ob, "after-dump") == (True, {"order": "after-dump"})
        assert ob.cache is not None
        assert ob.cache.client.get(ob.cache.redis_key("shop", "after-dump")) is not None
    # The nightly dump is restored into a fresh cluster: same secret, same OIDs.
    _restore(clusters, second, nightly)
    before, after = _identity(first), _identity(second)
    assert (after.database_oid, after.keys_oid) == (before.database_oid, before.keys_oid)
    assert after.system_identifier != before.system_identifier
    with _outbox(second, redis_url, redis_prefix) as restored:
        # The client's retry: the restored database never saw the key, so the body runs.
        assert place(restored, "after-dump") == (False, {"order": "after-dump"})
        assert count(restored.engine, "orders") == 1
        assert place(restored, "after-dump") == (True, {"order": "after-dump"})


def test_a_promoted_standby_runs_keys_its_primary_committed_after_it_lost_contact(
    clusters: Clusters, database_url: str, redis_url: str, redis_prefix: str
) -> None:
    main = sa.engine.make_url(database_url)
    assert main.database is not None
    seed = _dump(clusters, main.port or 5432, main.database, "seed.dump")
    (primary_port,) = _fresh_clusters(clusters, "primary")
    _restore(clusters, primary_port, seed)
    create_orders(sa.create_engine(_url(primary_port), poolclass=sa.NullPool))
    standby = clusters.root / "standby"
    clusters.run("pg_basebackup", "-h", "127.0.0.1", "-p", str(primary_port), "-U", "postgres",
                 "-D", str(standby), "-X", "stream", "-c", "fast", "-N")  # fmt: skip
    # The standby holds everything up to here; what the primary commits next never reaches
    # it (asynchronous replication that lost its last commits).
    with _outbox(primary_port, redis_url, redis_prefix) as ob:
        assert place(ob, "lost") == (False, {"order": "lost"})
        assert place(ob, "lost") == (True, {"order": "lost"})
    before = _identity(primary_port)
    clusters.stop(clusters.root / "primary")
    (standby / "standby.signal").touch()
    standby_port = clusters.start(standby)
    clusters.run("pg_ctl", "promote", "-w", "-D", str(standby))
    after = _identity(standby_port)
    assert (after.database_oid, after.keys_oid, after.system_identifier) == (
        before.database_oid,
        before.keys_oid,
        before.system_identifier,
    )
    assert after.timeline != before.timeline
    with _outbox(standby_port, redis_url, redis_prefix) as promoted:
        assert count(promoted.engine, "orders") == 0
        assert place(promoted, "lost") == (False, {"order": "lost"})
        assert place(promoted, "lost") == (True, {"order": "lost"})
        assert count(promoted.engine, "orders") == 1
