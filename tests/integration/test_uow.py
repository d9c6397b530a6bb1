"""Unit-of-work semantics on the real PostgreSQL and Redis."""

from __future__ import annotations

import contextlib
import json
import threading
import uuid
from collections.abc import Iterator

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import outbox
from outbox import OutboxConfig
from outbox._core.codec import decode_headers
from outbox.errors import (
    InvalidKeyError,
    InvalidTopicError,
    KeyInProgress,
    KeyReuseError,
    PayloadTooLargeError,
    PermanentError,
    PreviouslyFailed,
    ReplayedWriteError,
    SerializationError,
    ValidationError,
)
from tests.fixtures.uow import INSERT_ORDER, DbActivity, count, create_orders, rows, watch


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    order_key: Mapped[str]
    amount: Mapped[int]


@pytest.fixture
def ob(engine: sa.Engine, redis_url: str, redis_prefix: str) -> Iterator[outbox.Outbox]:
    create_orders(engine)
    with outbox.Outbox(
        engine, redis=_redis(redis_url), config=OutboxConfig(cache_prefix=redis_prefix)
    ) as instance:
        yield instance


@pytest.fixture
def ob_pg(engine: sa.Engine) -> Iterator[outbox.Outbox]:
    """An Outbox without Redis: every answer comes from PostgreSQL."""
    create_orders(engine)
    with outbox.Outbox(engine) as instance:
        yield instance


def _redis(url: str) -> object:
    from outbox._redis.cache import make_cache_client

    return make_cache_client(url, OutboxConfig())


def place(ob: outbox.Outbox, key: str, amount: int = 10, **kw: object) -> tuple[bool, object]:
    with ob.unit_of_work(key, **kw) as uow:  # type: ignore[arg-type]
        if uow.replayed:
            return True, uow.result
        uow.connection.execute(INSERT_ORDER, {"k": key, "a": amount})
        uow.publish("orders.created", {"key": key, "amount": amount}, key=key)
        uow.result = {"order": key, "amount": amount}
        return False, uow.result


# --------------------------------------------------------------------------- one transaction


def test_business_rows_key_and_events_commit_together(ob: outbox.Outbox) -> None:
    with ob.unit_of_work("order-1", scope="payments") as uow:
        assert not uow.replayed
        uow.session.add(Order(order_key="order-1", amount=5))
        uow.connection.execute(INSERT_ORDER, {"k": "order-1", "a": 7})
        first = uow.publish(
            "orders.created", {"id": 1}, key="1", headers={"source": "api", "raw": b"\x00\xff"}
        )
        second = uow.publish("orders.audit", "plain text")
        third = uow.publish("orders.blob", b"\x01\x02", key=b"\xfe")
        uow.result = {"order_id": 1}
    assert isinstance(first, uuid.UUID) and first != second != third
    engine = ob.engine
    assert count(engine, "orders", "order_key = 'order-1'") == 2
    (key_row,) = rows(engine, "SELECT scope, key, status, result FROM idempotency_keys")
    assert tuple(key_row) == ("payments", "order-1", "completed", {"order_id": 1})
    events = rows(engine, "SELECT id, event_id, topic, key, value, headers FROM outbox ORDER BY id")
    assert [e.event_id for e in events] == [first, second, third]
    assert [e.topic for e in events] == ["orders.created", "orders.audit", "orders.blob"]
    assert events[0].key == b"1" and events[1].key is None and events[2].key == b"\xfe"
    assert json.loads(events[0].value) == {"id": 1}
    assert events[1].value == b"plain text"
    assert events[2].value == b"\x01\x02"
    assert dict(decode_headers(events[0].headers)) == {
        "source": b"api",
        "raw": b"\x00\xff",
        "content-type": b"application/json",
    }
    assert dict(decode_headers(events[1].headers))["content-type"].startswith(b"text/plain")
    assert dict(decode_headers(events[2].headers))["content-type"] == b"application/octet-stream"


def test_outbox_rows_are_inserted_in_one_statement_at_the_end(ob_pg: outbox.Outbox) -> None:
    engine = ob_pg.engine
    with ob_pg.unit_of_work("k") as uow:
        uow.connection.execute(INSERT_ORDER, {"k": "k", "a": 1})
        for i in range(3):
            uow.publish("t", {"i": i}, key="same")
        uow.connection.execute(INSERT_ORDER, {"k": "k", "a": 2})
        # Nothing is written before the end of the unit of work.
        with engine.connect() as other:
            assert other.execute(sa.text("SELECT count(*) FROM outbox")).scalar() == 0
    # Rows written by one statement share its command id (cmin) within the transaction (xmin).
    (key_row,) = rows(engine, "SELECT xmin::text AS x, cmin::text::int AS c FROM idempotency_keys")
    events = rows(
        engine, "SELECT xmin::text AS x, cmin::text::int AS c, value FROM outbox ORDER BY id"
    )
    orders = rows(engine, "SELECT xmin::text AS x, cmin::text::int AS c FROM orders ORDER BY id")
    assert {(e.x, e.c) for e in events} == {(key_row.x, key_row.c)}  # one statement, with the key
    assert {o.x for o in orders} == {key_row.x}  # one transaction
    assert max(o.c for o in orders) < key_row.c  # after every business write
    assert [json.loads(e.value)["i"] for e in events] == [0, 1, 2]  # id order = publish order


def test_publish_returns_uuid_and_keeps_publisher_idempotency_header(ob: outbox.Outbox) -> None:
    with ob.unit_of_work("k") as uow:
        event_id = uow.publish("t", {"a": 1}, headers={"X-Idempotency-Key": "mine"})
        assert uow.event_ids == [event_id]
    (row,) = rows(ob.engine, "SELECT event_id, headers FROM outbox")
    assert row.event_id == event_id
    assert row.headers["X-Idempotency-Key"] == "mine"


# --------------------------------------------------------------------------- duplicates


def test_duplicate_replays_stored_result_without_running(ob_pg: outbox.Outbox) -> None:
    assert place(ob_pg, "dup-1", 42) == (False, {"order": "dup-1", "amount": 42})
    ran = []
    with ob_pg.unit_of_work("dup-1") as uow:
        assert uow.replayed
        assert uow.result == {"order": "dup-1", "amount": 42}
        ran.append(True)
    assert place(ob_pg, "dup-1", 99) == (True, {"order": "dup-1", "amount": 42})
    assert count(ob_pg.engine, "orders") == 1
    assert count(ob_pg.engine, "outbox") == 1


@pytest.mark.parametrize("cached", [True, False], ids=["redis", "postgres"])
def test_writes_inside_a_replayed_unit_of_work_raise(
    ob: outbox.Outbox, ob_pg: outbox.Outbox, cached: bool
) -> None:
    instance = ob if cached else ob_pg
    place(instance, "done")
    place(instance, "done")  # warm the cache for the Redis case
    with instance.unit_of_work("done") as uow:
        assert uow.replayed
        with pytest.raises(ReplayedWriteError):
            _ = uow.session
        with pytest.raises(ReplayedWriteError):
            _ = uow.connection
        with pytest.raises(ReplayedWriteError):
            uow.publish("t", {"x": 1})
        with pytest.raises(ReplayedWriteError):
            uow.result = {"other": True}
        assert uow.result == {"order": "done", "amount": 10}
    assert count(instance.engine, "orders") == 1
    assert count(instance.engine, "outbox") == 1


def test_result_none_is_replayed_as_none(ob_pg: outbox.Outbox) -> None:
    with ob_pg.unit_of_work("no-result") as uow:
        assert uow.result is None
    with ob_pg.unit_of_work("no-result") as uow:
        assert uow.replayed and uow.result is None


def test_scopes_are_independent(ob_pg: outbox.Outbox) -> None:
    assert place(ob_pg, "same-key", scope="billing")[0] is False
    assert place(ob_pg, "same-key", scope="shipping")[0] is False
    assert place(ob_pg, "same-key", scope="billing")[0] is True
    assert count(ob_pg.engine, "idempotency_keys") == 2


def test_fingerprint_mismatch_raises_key_reuse(ob: outbox.Outbox) -> None:
    place(ob, "fp-key", fingerprint="sha256:aaa")
    assert place(ob, "fp-key", fingerprint="sha256:aaa")[0] is True
    with pytest.raises(KeyReuseError) as info:
        place(ob, "fp-key", fingerprint="sha256:bbb")
    assert info.value.key == "fp-key"
    # Also when the answer comes from PostgreSQL rather than Redis.
    ob.cache.client.delete(ob.cache.redis_key("default", "fp-key"))  # type: ignore[union-attr]
    with pytest.raises(KeyReuseError):
        place(ob, "fp-key", fingerprint="sha256:bbb")
    # Without a fingerprint, a duplicate is a plain replay.
    assert place(ob, "fp-key")[0] is True
    assert count(ob.engine, "orders") == 1


# --------------------------------------------------------------------------- failures


def test_permanent_error_rolls_back_and_records_failure(ob: outbox.Outbox) -> None:
    with pytest.raises(PermanentError, match="card declined"), ob.unit_of_work("pay-1") as uow:
        uow.connection.execute(INSERT_ORDER, {"k": "pay-1", "a": 1})
        uow.publish("payments.charged", {"ok": True})
        raise PermanentError("card declined")
    assert count(ob.engine, "orders") == 0
    assert count(ob.engine, "outbox") == 0
    (row,) = rows(ob.engine, "SELECT status, error FROM idempotency_keys")
    assert row.status == "failed" and "card declined" in row.error

    calls = []
    for _ in range(2):  # PostgreSQL answers once, then the cache
        with pytest.raises(PreviouslyFailed) as info, ob.unit_of_work("pay-1"):
            calls.append(1)
        assert "card declined" in info.value.error
    assert calls == []


def test_configured_exception_types_count_as_permanent(engine: sa.Engine) -> None:
    class Declined(Exception):
        pass

    create_orders(engine)
    with outbox.Outbox(engine, config=OutboxConfig(permanent_errors=(Declined,))) as ob:
        with pytest.raises(Declined), ob.unit_of_work("p"):
            raise Declined("insufficient funds")
        with pytest.raises(PreviouslyFailed, match="Declined: insufficient funds"):
            place(ob, "p")


def test_other_exceptions_roll_back_and_leave_the_key_free(ob: outbox.Outbox) -> None:
    with pytest.raises(RuntimeError), ob.unit_of_work("retry-me") as uow:
        uow.connection.execute(INSERT_ORDER, {"k": "retry-me", "a": 1})
        uow.publish("t", {"n": 1})
        raise RuntimeError("transient")
    assert count(ob.engine, "orders") == 0
    assert count(ob.engine, "outbox") == 0
    assert count(ob.engine, "idempotency_keys") == 0
    assert place(ob, "retry-me") == (False, {"order": "retry-me", "amount": 10})
    assert count(ob.engine, "orders") == 1


def test_database_error_in_body_rolls_back_everything(ob_pg: outbox.Outbox) -> None:
    with pytest.raises(sa.exc.IntegrityError), ob_pg.unit_of_work("bad-sql") as uow:
        uow.connection.execute(INSERT_ORDER, {"k": "bad-sql", "a": 1})
        uow.publish("t", {"n": 1})
        uow.connection.execute(
            sa.text("INSERT INTO orders (id, order_key, amount) VALUES (1, 'x', 1)")
        )
        uow.connection.execute(
            sa.text("INSERT INTO orders (id, order_key, amount) VALUES (1, 'x', 1)")
        )
    assert count(ob_pg.engine, "orders") == 0
    assert count(ob_pg.engine, "idempotency_keys") == 0
    # The pooled connection is healthy afterwards.
    assert place(ob_pg, "bad-sql")[0] is False


# --------------------------------------------------------------------------- fail fast


def test_concurrent_attempt_gets_key_in_progress_at_once(ob_pg: outbox.Outbox) -> None:
    holding = threading.Event()
    release = threading.Event()
    errors: list[BaseException] = []

    def first() -> None:
        try:
            with ob_pg.unit_of_work("busy") as uow:
                uow.connection.execute(INSERT_ORDER, {"k": "busy", "a": 1})
                holding.set()
                assert release.wait(30)
                uow.result = "first"
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    t = threading.Thread(target=first)
    t.start()
    assert holding.wait(30)
    try:
        # The other transaction is open and holds the key: a second attempt must not wait for
        # it. The holder keeps waiting on `release`, so had this call blocked on a lock, the
        # test would hang until pytest-timeout fails it.
        with pytest.raises(KeyInProgress), ob_pg.unit_of_work("busy"):
            pytest.fail("the body of a concurrent attempt ran")
    finally:
        release.set()
        t.join()
    assert errors == []
    with ob_pg.unit_of_work("busy") as uow:
        assert uow.replayed and uow.result == "first"


def test_first_insert_race_fails_fast_not_waits(engine: sa.Engine) -> None:
    """Two attempts on a brand-new key: the second must not wait on the first's INSERT."""
    create_orders(engine)
    with outbox.Outbox(engine) as ob:
        in_body = threading.Event()
        release = threading.Event()

        def first() -> None:
            with ob.unit_of_work("fresh") as uow:
                in_body.set()
                release.wait(30)
                uow.publish("t", {"first": True})

        t = threading.Thread(target=first)
        t.start()
        assert in_body.wait(30)
        outcome: list[BaseException | None] = []

        def second() -> None:
            try:
                with ob.unit_of_work("fresh"):
                    outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        try:
            # Had the second attempt waited on the first one's lock, it would still be waiting:
            # the first attempt is parked on `release` until after this check.
            s = threading.Thread(target=second)
            s.start()
            s.join(timeout=10)
            if s.is_alive():  # say what it waits on: a lock wait shows in pg_stat_activity
                with engine.connect() as probe:
                    waits = probe.execute(
                        sa.text(
                            "SELECT wait_event_type, wait_event, state FROM pg_stat_activity "
                            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                        )
                    ).all()
                pytest.fail(f"the second attempt is waiting for the first: {waits}")
            assert len(outcome) == 1 and isinstance(outcome[0], KeyInProgress)
        finally:
            release.set()
            t.join()
        assert count(engine, "outbox") == 1


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("key", "scope", "fingerprint", "error"),
    [
        ("", "default", None, InvalidKeyError),
        ("k" * 256, "default", None, InvalidKeyError),
        (42, "default", None, InvalidKeyError),
        (b"bytes", "default", None, InvalidKeyError),
        ("nul\x00key", "default", None, InvalidKeyError),
        ("ok", "", None, InvalidKeyError),
        ("ok", "bad scope!", None, InvalidKeyError),
        ("ok", None, None, InvalidKeyError),
        ("ok", "default", 7, InvalidKeyError),
    ],
)
def test_bad_key_scope_fingerprint_refused_before_io(
    ob: outbox.Outbox, key: object, scope: object, fingerprint: object, error: type[Exception]
) -> None:
    with watch(ob.engine) as activity, pytest.raises(error):
        ob.unit_of_work(key, scope=scope, fingerprint=fingerprint)  # type: ignore[arg-type]
    assert activity.total == 0
    assert ob.cache is not None
    assert _cache_keys(ob) == []


def _bad_publish(name: str):  # type: ignore[no-untyped-def]
    cases = {
        "topic-empty": (lambda u: u.publish("", {"a": 1}), InvalidTopicError),
        "topic-space": (lambda u: u.publish("has space", {"a": 1}), InvalidTopicError),
        "topic-dotdot": (lambda u: u.publish("..", {"a": 1}), InvalidTopicError),
        "topic-long": (lambda u: u.publish("t" * 250, {"a": 1}), InvalidTopicError),
        "value-object": (lambda u: u.publish("t", object()), SerializationError),
        "value-nan": (lambda u: u.publish("t", {"x": float("nan")}), SerializationError),
        "value-set": (lambda u: u.publish("t", {1, 2}), SerializationError),
        "value-too-large": (
            lambda u: u.publish("t", b"x" * (1024 * 1024 + 1)),
            PayloadTooLargeError,
        ),
        "key-int": (lambda u: u.publish("t", {"a": 1}, key=5), SerializationError),
        "header-int": (lambda u: u.publish("t", {"a": 1}, headers={"h": 1}), SerializationError),
        "headers-list": (
            lambda u: u.publish("t", {"a": 1}, headers=[("h", "v")]),
            SerializationError,
        ),
        "idem-header-empty": (
            lambda u: u.publish("t", b"v", headers={"X-Idempotency-Key": ""}),
            InvalidKeyError,
        ),
        "idem-header-long": (
            lambda u: u.publish("t", b"v", headers={"x-idempotency-key": "k" * 256}),
            InvalidKeyError,
        ),
        "idem-header-binary": (
            lambda u: u.publish("t", b"v", headers={"X-Idempotency-Key": b"\xff"}),
            InvalidKeyError,
        ),
        "result-object": (lambda u: setattr(u, "result", object()), SerializationError),
        "result-nul": (lambda u: setattr(u, "result", "a\x00b"), SerializationError),
    }
    return cases[name]


@pytest.mark.parametrize(
    "case",
    [
        "topic-empty",
        "topic-space",
        "topic-dotdot",
        "topic-long",
        "value-object",
        "value-nan",
        "value-set",
        "value-too-large",
        "key-int",
        "header-int",
        "headers-list",
        "idem-header-empty",
        "idem-header-long",
        "idem-header-binary",
        "result-object",
        "result-nul",
    ],
)
def test_bad_publish_or_result_raises_and_commits_nothing(ob: outbox.Outbox, case: str) -> None:
    action, error = _bad_publish(case)
    activity: DbActivity | None = None
    with pytest.raises(error), ob.unit_of_work(f"bad-{case}") as uow:
        uow.connection.execute(INSERT_ORDER, {"k": case, "a": 1})
        uow.publish("t", {"good": True})
        with watch(ob.engine) as activity:
            action(uow)
    # The window around the refused call closed when it raised, before the unit of work
    # rolled back: the refusal itself reached neither the pool nor the server.
    assert activity is not None
    assert activity.total == 0, activity.statements
    assert count(ob.engine, "orders") == 0
    assert count(ob.engine, "outbox") == 0
    assert count(ob.engine, "idempotency_keys") == 0
    assert ob.cache is not None
    assert _cache_keys(ob) == []
    assert issubclass(error, ValidationError)


def test_size_limit_is_configurable(engine: sa.Engine) -> None:
    with outbox.Outbox(engine, config=OutboxConfig(max_payload_bytes=200)) as ob:
        with pytest.raises(PayloadTooLargeError), ob.unit_of_work("big") as uow:
            uow.publish("t", b"x" * 90, key="k" * 5, headers={"h": "v" * 10})
        with ob.unit_of_work("small") as uow:
            uow.publish("t", b"x" * 40, key="k" * 5, headers={"h": "v" * 10})
    assert count(engine, "outbox") == 1


def test_result_mutated_after_assignment_is_validated_at_commit(ob_pg: outbox.Outbox) -> None:
    result: dict[str, object] = {"ok": True}
    with pytest.raises(SerializationError), ob_pg.unit_of_work("late") as uow:
        uow.connection.execute(INSERT_ORDER, {"k": "late", "a": 1})
        uow.result = result
        result["bad"] = object()
    assert count(ob_pg.engine, "orders") == 0
    assert count(ob_pg.engine, "idempotency_keys") == 0


def test_large_and_many_events_take_the_other_statement_paths(ob_pg: outbox.Outbox) -> None:
    with ob_pg.unit_of_work("big") as uow:
        uow.publish("t", b"v" * 200_000, key="big")
    with ob_pg.unit_of_work("many") as uow:
        for i in range(40):
            uow.publish("t", {"i": i}, key="many")
    sizes = rows(ob_pg.engine, "SELECT key, length(value) AS n FROM outbox ORDER BY id")
    assert sizes[0].n == 200_000
    assert [
        json.loads(v.value)["i"]
        for v in rows(
            ob_pg.engine, "SELECT value FROM outbox WHERE key = 'many'::bytea ORDER BY id"
        )
    ] == list(range(40))
    assert count(ob_pg.engine, "idempotency_keys", "status = 'completed'") == 2


@pytest.mark.parametrize("end", ["commit", "rollback"])
def test_ending_the_transaction_inside_the_body_is_refused(ob_pg: outbox.Outbox, end: str) -> None:
    from outbox.errors import TransactionEndedError

    with pytest.raises(TransactionEndedError), ob_pg.unit_of_work("sneaky") as uow:
        uow.connection.execute(INSERT_ORDER, {"k": "sneaky", "a": 1})
        getattr(uow.connection, end)()  # a commit is refused here; a rollback is allowed...
        uow.connection.execute(INSERT_ORDER, {"k": "after", "a": 1})  # ...but nothing after it
    assert count(ob_pg.engine, "orders") == 0
    assert count(ob_pg.engine, "idempotency_keys") == 0
    # Savepoints stay available, and the connection is fine afterwards.
    with ob_pg.unit_of_work("nested") as uow:
        with uow.connection.begin_nested() as sp:
            uow.connection.execute(INSERT_ORDER, {"k": "inner", "a": 1})
            sp.rollback()
        uow.connection.execute(INSERT_ORDER, {"k": "outer", "a": 1})
    assert [r.order_key for r in rows(ob_pg.engine, "SELECT order_key FROM orders")] == ["outer"]
    # A plain connection of the same engine commits as usual.
    with ob_pg.engine.connect() as conn:
        conn.execute(INSERT_ORDER, {"k": "plain", "a": 1})
        conn.commit()
    assert count(ob_pg.engine, "orders") == 2


def test_orm_flush_error_surfaces_as_itself(ob_pg: outbox.Outbox) -> None:
    with pytest.raises(sa.exc.IntegrityError), ob_pg.unit_of_work("orm-dup") as uow:
        uow.session.add(Order(id=1, order_key="a", amount=1))
        uow.session.flush()
        uow.session.add(Order(id=1, order_key="b", amount=1))
        uow.session.flush()
    assert count(ob_pg.engine, "orders") == 0
    # A body that swallows the error cannot go on outside the transaction either.
    from outbox.errors import TransactionEndedError

    with pytest.raises(TransactionEndedError), ob_pg.unit_of_work("orm-dup") as uow:
        uow.session.add(Order(id=5, order_key="a", amount=1))
        uow.session.flush()
        uow.session.add(Order(id=5, order_key="b", amount=1))
        with contextlib.suppress(sa.exc.IntegrityError):
            uow.session.flush()
        uow.connection.execute(INSERT_ORDER, {"k": "outside", "a": 1})
    assert count(ob_pg.engine, "orders") == 0
    assert count(ob_pg.engine, "idempotency_keys") == 0
    with ob_pg.unit_of_work("orm-dup") as uow:
        uow.session.add(Order(id=1, order_key="a", amount=1))
    assert count(ob_pg.engine, "orders") == 1


def test_failure_is_recorded_while_the_key_stays_held(
    ob_pg: outbox.Outbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the rollback of a failed body and its failure record, nobody may run the key."""
    from outbox._pg import transaction as _tx

    seen: list[str] = []
    raced: list[bool] = []
    original = _tx.Transaction._rollback

    def rollback_then_race(self: _tx.Transaction) -> None:
        original(self)
        if raced:
            return
        raced.append(True)

        # Right after the rollback, before the failure is recorded: a concurrent attempt.
        def concurrent() -> None:
            try:
                with ob_pg.unit_of_work("declined") as uow:
                    uow.connection.execute(INSERT_ORDER, {"k": "declined", "a": 2})
                seen.append("ran")
            except KeyInProgress:
                seen.append("in-progress")
            except PreviouslyFailed:
                seen.append("failed")

        t = threading.Thread(target=concurrent)
        t.start()
        t.join(timeout=30)

    monkeypatch.setattr(_tx.Transaction, "_rollback", rollback_then_race)
    with pytest.raises(PermanentError), ob_pg.unit_of_work("declined") as uow:
        uow.connection.execute(INSERT_ORDER, {"k": "declined", "a": 1})
        raise PermanentError("declined")
    assert seen == ["in-progress"]
    assert count(ob_pg.engine, "orders") == 0
    (row,) = rows(ob_pg.engine, "SELECT status, error FROM idempotency_keys")
    assert row.status == "failed"
    # The session lock was released: the key answers at once.
    with pytest.raises(PreviouslyFailed):
        place(ob_pg, "declined")
    with ob_pg.engine.connect() as conn:
        held = conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = "
                "(SELECT oid FROM pg_database WHERE datname = current_database())"
            )
        )
        assert held.scalar() == 0


def test_permanent_error_after_a_failed_statement_is_still_recorded(ob_pg: outbox.Outbox) -> None:
    with pytest.raises(PermanentError), ob_pg.unit_of_work("aborted") as uow:
        uow.connection.execute(INSERT_ORDER, {"k": "aborted", "a": 1})
        try:
            uow.connection.execute(sa.text("SELECT 1/0"))
        except sa.exc.DataError as exc:
            raise PermanentError("division failed") from exc
    assert count(ob_pg.engine, "orders") == 0
    (row,) = rows(ob_pg.engine, "SELECT status, error FROM idempotency_keys")
    assert (row.status, row.error) == ("failed", "PermanentError: division failed")


def _cache_keys(ob: outbox.Outbox) -> list[bytes]:
    """The toolkit's keys in Redis, read with a patient client: a SCAN of a busy shared Redis
    takes longer than the fast path's 50 ms timeout."""
    assert ob.cache is not None
    kwargs = ob.cache.client.connection_pool.connection_kwargs
    client = redis.Redis(host=kwargs["host"], port=kwargs["port"], db=kwargs.get("db", 0))
    try:
        return list(client.scan_iter(match=f"{ob.config.cache_prefix}*", count=1000))
    finally:
        client.close()
