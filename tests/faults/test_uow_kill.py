"""SIGKILL in the middle of a unit of work: nothing remains, the key is free at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import sqlalchemy as sa

import outbox
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
    assert count(engine, "orders") == 1
    assert count(engine, "orders", "amount = 2") == 1
    assert count(engine, "outbox") == 0
    assert count(engine, "idempotency_keys", "result = '{\"second\": true}'::jsonb") == 1
