"""The unit of work under faults: SIGKILLed mid-body, nothing remains and the key is free at once;
its connection cut mid-body, the driver's own error surfaces and the key stays free; cut at
COMMIT, the attempt fails without a cache entry and the next one finds the one outcome."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import redis
import sqlalchemy as sa

import outbox
from tests.fixtures.common import wait_for
from tests.fixtures.uow import INSERT_ORDER, count, create_orders

CHILD = textwrap.dedent(
    """
    import sys, time
    import sqlalchemy as sa
    import outbox
    ob = outbox.Outbox(sys.argv[1])
    with ob.unit_of_work("victim", scope="kill") as uow:
        uow.connection.execute(
            sa.text("INSERT INTO orders (order_key, amount) VALUES ('victim', 1)")
        )
        uow.publish("orders.created", {"id": 1}, key="victim")
        uow.result = {"never": "committed"}
        print("in-body", flush=True)
        time.sleep(600)
    """
)


def test_sigkill_mid_body_leaves_nothing_and_frees_the_key(
    engine: sa.Engine, database_url: str
) -> None:
    create_orders(engine)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, database_url], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "in-body"
        # The child holds the key: a concurrent attempt is refused.
        with outbox.Outbox(engine) as ob:
            try:
                with ob.unit_of_work("victim", scope="kill"):
                    raise AssertionError("ran while the child held the key")
            except outbox.KeyInProgress:
                pass
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
            killed_at = time.monotonic()
            # The server sees the connection close when the kernel closes the dead process's
            # socket; the key's lock goes with the backend's transaction. Allow the backend a
            # moment to notice, and measure it: no lock timeout, no lease to expire.
            attempts = 0
            while True:
                attempts += 1
                try:
                    with ob.unit_of_work("victim", scope="kill") as uow:
                        assert not uow.replayed
                        uow.connection.execute(INSERT_ORDER, {"k": "victim", "a": 2})
                        uow.result = {"second": True}
                    break
                except outbox.KeyInProgress:
                    # A deadline against hanging forever, not a speed target (that is
                    # measured, and printed below).
                    assert time.monotonic() - killed_at < 30, "key still held 30 s after SIGKILL"
                    time.sleep(0.005)
            print(
                f"key free {1000 * (time.monotonic() - killed_at):.1f} ms after SIGKILL, "
                f"{attempts} attempt(s)"
            )
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()
    assert count(engine, "orders") == 1
    assert count(engine, "orders", "amount = 2") == 1
    assert count(engine, "outbox") == 0
    assert count(engine, "idempotency_keys", "result = '{\"second\": true}'::jsonb") == 1


def test_connection_lost_in_the_body_surfaces_as_the_drivers_error(
    database_url: str, tcp_proxy: Any
) -> None:
    """A connection that dies mid-body raises the driver's own error (marked as a lost
    connection), not a follow-up error from the cleanup; the key stays free and the next
    attempt, on a fresh connection, commits."""
    url = sa.make_url(database_url)
    proxy = tcp_proxy(url.host or "127.0.0.1", url.port or 5432)
    ob = outbox.Outbox(url.set(port=proxy.port).render_as_string(hide_password=False))
    try:
        with pytest.raises(sa.exc.OperationalError) as info, ob.unit_of_work("lost-1") as uow:
            proxy.cut()
            uow.connection.execute(sa.text("SELECT 1"))
        assert info.value.connection_invalidated
        proxy.restore()

        # The server ends the cut connection's backend, and its lock on the key, when it reads
        # the closed socket: at once on an idle machine, a moment later on a busy one. Until
        # then the key is busy and the next attempt fails fast, as next to any live attempt.
        def next_attempt_commits() -> bool:
            try:
                with ob.unit_of_work("lost-1") as uow:
                    assert not uow.replayed
                    uow.result = "done"
            except outbox.KeyInProgress:
                return False
            return True

        wait_for(next_attempt_commits, 10, "the key was not freed after its connection was cut")
        with ob.unit_of_work("lost-1") as uow:
            assert uow.replayed and uow.result == "done"
    finally:
        ob.close()


@pytest.mark.parametrize("reached_server", [False, True], ids=["commit-lost", "answer-lost"])
def test_a_connection_cut_at_commit_leaves_one_outcome_and_no_cache_entry(
    engine: sa.Engine,
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    tcp_proxy: Any,
    reached_server: bool,
) -> None:
    """The in-doubt commit: the connection dies as the final statement and COMMIT go out --
    before they reach the server, or after it committed and before its answer came back. The
    attempt fails (it cannot know), Redis learns nothing, and the next attempt either runs the
    body (nothing committed) or replays the committed outcome: one effect either way."""
    create_orders(engine)
    url = sa.make_url(database_url)
    proxy = tcp_proxy(url.host or "127.0.0.1", url.port or 5432)
    ob = outbox.Outbox(
        url.set(port=proxy.port).render_as_string(hide_password=False),
        redis_url=redis_url,
        config=outbox.OutboxConfig(cache_prefix=redis_prefix),
    )
    cache = redis.Redis.from_url(redis_url)
    try:
        with pytest.raises(sa.exc.OperationalError), ob.unit_of_work("doubt") as uow:
            uow.connection.execute(INSERT_ORDER, {"k": "doubt", "a": 1})
            uow.publish("orders.created", {"order": "doubt"}, key="doubt")
            uow.result = {"order": "doubt"}
            proxy.cut_at(b"COMMIT", deliver=reached_server)
        assert proxy.triggered.is_set(), "the cut did not land on the commit"
        assert cache.keys(f"*{redis_prefix}*") == [], "the cache learned an unknown outcome"
        committed = count(engine, "idempotency_keys")
        assert committed == (1 if reached_server else 0)
        assert count(engine, "orders") == count(engine, "outbox") == committed

        ran: list[bool] = []

        def next_attempt() -> bool:  # the cut backend frees the key when it sees the socket
            try:
                with ob.unit_of_work("doubt") as again:
                    if not again.replayed:
                        again.connection.execute(INSERT_ORDER, {"k": "doubt", "a": 1})
                        again.publish("orders.created", {"order": "doubt"}, key="doubt")
                        again.result = {"order": "doubt"}
                    ran.append(not again.replayed)
                    assert again.result == {"order": "doubt"}
            except outbox.KeyInProgress:
                return False
            return True

        wait_for(next_attempt, 10, "the key was not freed after the cut")
        assert ran == [not reached_server]  # the body ran again only if nothing had committed
        assert count(engine, "orders") == count(engine, "outbox") == 1
        assert count(engine, "idempotency_keys") == 1
    finally:
        ob.close()
        cache.close()
