"""Pipelined statements sent in bursts (outbox._pg.coalesce) on a real PostgreSQL: held until a
burst is full or an answer is needed, then sent in order; a failure still surfaces."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from outbox._pg.coalesce import coalesce


@pytest.fixture
def driver(engine: sa.Engine) -> Iterator[Any]:
    raw = engine.raw_connection()
    try:
        conn = raw.driver_connection
        assert conn is not None
        conn.execute("CREATE TEMP TABLE burst (n int NOT NULL, at serial)")
        yield conn
        conn.rollback()
    finally:
        raw.close()


def test_statements_wait_for_a_full_burst_and_go_in_order(driver: Any) -> None:
    with driver.pipeline() as pipeline:
        assert coalesce(pipeline, burst=8)
        for n in range(5):
            driver.execute("INSERT INTO burst (n) VALUES (%s)", (n,), prepare=False)
        assert len(pipeline.command_queue) == 5  # none sent yet
        for n in range(5, 8):
            driver.execute("INSERT INTO burst (n) VALUES (%s)", (n,), prepare=False)
        assert len(pipeline.command_queue) == 0  # the burst went
        for n in range(8, 11):
            driver.execute("INSERT INTO burst (n) VALUES (%s)", (n,), prepare=False)
        assert len(pipeline.command_queue) == 3
        # Rows read: whatever is held goes first, so the answer counts it.
        row = driver.execute("SELECT count(*) FROM burst").fetchone()
        assert row == (11,)
        for n in range(11, 13):
            driver.execute("INSERT INTO burst (n) VALUES (%s)", (n,), prepare=False)
    # The pipeline's end sent the rest; the server ran them in the order executed.
    got = [r[0] for r in driver.execute("SELECT n FROM burst ORDER BY at").fetchall()]
    assert got == list(range(13))


def test_a_held_statement_that_fails_fails_the_pipeline(driver: Any) -> None:
    failed = pytest.raises(psycopg.errors.InvalidTextRepresentation)
    with failed, driver.pipeline() as pipeline:
        assert coalesce(pipeline, burst=64)
        driver.execute("INSERT INTO burst (n) VALUES (%s)", ("not a number",))
        driver.execute("INSERT INTO burst (n) VALUES (%s)", (1,))
        assert len(pipeline.command_queue) == 2  # held: the error comes at the end


def test_a_sync_sends_what_is_held(driver: Any) -> None:
    with driver.pipeline() as pipeline:
        assert coalesce(pipeline, burst=64)
        driver.execute("INSERT INTO burst (n) VALUES (1)")
        pipeline.sync()
        assert len(pipeline.command_queue) == 0
        assert driver.execute("SELECT count(*) FROM burst").fetchone() == (1,)


def test_without_the_hooks_the_pipeline_is_left_as_it_is() -> None:
    class Bare:
        command_queue: list[Any] = []

    assert not coalesce(Bare())
    assert not coalesce(object(), burst=1)


def test_a_burst_goes_out_in_one_write_not_one_per_statement(
    driver: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full burst is put in libpq's buffer whole and written at once: the connection waits on
    its socket a few times for it, not once per statement (each wait a poll and a send)."""
    waits = 0
    real = driver.wait

    def counting(gen: Any, *args: Any, **kwargs: Any) -> Any:
        def counted() -> Any:
            nonlocal waits
            try:
                asked = gen.send(None)
                while True:
                    waits += 1
                    asked = gen.send((yield asked))
            except StopIteration as stop:
                return stop.value

        return real(counted(), *args, **kwargs)

    with driver.pipeline() as pipeline:
        assert coalesce(pipeline, burst=64)
        monkeypatch.setattr(driver, "wait", counting)
        for n in range(64):
            driver.execute("INSERT INTO burst (n) VALUES (%s)", (n,), prepare=False)
        assert len(pipeline.command_queue) == 0  # the burst went
        assert 1 <= waits <= 4, waits
        monkeypatch.undo()
    assert driver.execute("SELECT count(*) FROM burst").fetchone() == (64,)
