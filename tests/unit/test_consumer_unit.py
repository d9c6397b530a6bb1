"""Pure parts of the consumer runner: backoff, key lookup, configuration, handler loading."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, strategies as st

from outbox._core.retry import Backoff, backoff_delay
from outbox._kafka.consumer import header_key, message_headers
from outbox.cli.consume import load_handler
from outbox.consumer import ConsumerConfig
from outbox.errors import ConfigurationError, InvalidKeyError, InvalidTopicError


class FakeMessage:
    """Stands in for confluent_kafka.Message where only headers() is read."""

    def __init__(self, headers: Any) -> None:
        self._headers = headers

    def headers(self) -> Any:
        return self._headers


def config(**overrides: Any) -> ConsumerConfig:
    settings: dict[str, Any] = {"topics": ["orders"], "group": "billing",
                                "bootstrap_servers": "k:9092"}  # fmt: skip
    settings.update(overrides)
    return ConsumerConfig(**settings)


def test_backoff_grows_doubles_and_is_capped() -> None:
    assert backoff_delay(1, 0.1, 5.0, rand=lambda: 1.0) == pytest.approx(0.1)
    assert backoff_delay(3, 0.1, 5.0, rand=lambda: 1.0) == pytest.approx(0.4)
    assert backoff_delay(30, 0.1, 5.0, rand=lambda: 1.0) == pytest.approx(5.0)
    # Jitter keeps at least half of the nominal delay.
    assert backoff_delay(3, 0.1, 5.0, rand=lambda: 0.0) == pytest.approx(0.2)


@given(
    attempt=st.integers(min_value=0, max_value=10**9),
    initial=st.floats(min_value=1e-6, max_value=60.0),
    factor=st.floats(min_value=1.0, max_value=1e6),
)
def test_backoff_stays_within_its_cap_for_any_count(
    attempt: int, initial: float, factor: float
) -> None:
    # A count of retries that do not count (a days-long outage, a key held for hours) grows
    # without bound; the delay never overflows and never passes its cap.
    maximum = initial * factor
    delay = backoff_delay(attempt, initial, maximum)
    assert 0 < delay <= maximum
    backoff = Backoff(initial, maximum)
    backoff.failures = attempt
    assert 0 < backoff.failed() <= maximum


def test_header_key_takes_the_first_matching_header() -> None:
    msg = FakeMessage([("other", b"x"), ("X-Idempotency-Key", b"k1"), ("X-Idempotency-Key", b"k2")])
    assert header_key(msg, "X-Idempotency-Key") == "k1"  # type: ignore[arg-type]
    assert header_key(FakeMessage(None), "X-Idempotency-Key") is None  # type: ignore[arg-type]
    # Matched without regard to case, like the relay's check for a publisher's own header.
    assert header_key(FakeMessage([("x-idempotency-key", b"k")]),  # type: ignore[arg-type]
                      "X-Idempotency-Key") == "k"  # fmt: skip
    with pytest.raises(InvalidKeyError, match="not UTF-8"):
        header_key(FakeMessage([("k", b"\xff\xfe")]), "k")  # type: ignore[arg-type]


def test_message_headers_normalises_str_values() -> None:
    assert message_headers(FakeMessage([("a", "x"), ("b", None)])) == [  # type: ignore[arg-type]
        ("a", b"x"),
        ("b", None),
    ]


def test_config_defaults_scope_to_group_and_validates() -> None:
    cfg = config().validate()
    assert cfg.topics == ("orders",)
    assert cfg.effective_scope == "billing"
    assert config(scope="billing.v2").effective_scope == "billing.v2"
    from_config = config(bootstrap_servers=None, kafka_config={"bootstrap.servers": "b:1"})
    assert from_config.effective_bootstrap == "b:1"


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"topics": []}, ConfigurationError, "no topics"),
        ({"topics": ["bad topic"]}, InvalidTopicError, "invalid topic"),
        ({"dlq_topic_suffix": ""}, ConfigurationError, "dlq_topic_suffix"),
        ({"group": " "}, ConfigurationError, "group"),
        ({"group": "has space"}, ConfigurationError, "scope"),
        ({"bootstrap_servers": None}, ConfigurationError, "bootstrap"),
        ({"max_attempts": 0}, ConfigurationError, "max_attempts"),
        ({"retry_backoff": 0}, ConfigurationError, "retry_backoff"),
        ({"kafka_config": {"enable.auto.commit": "true"}}, ConfigurationError, "auto.commit"),
        ({"kafka_config": {"group.id": "other"}}, ConfigurationError, "disagrees"),
    ],
)
def test_config_refuses(overrides: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        config(**overrides).validate()


def test_load_handler() -> None:
    assert load_handler("outbox.consumer:backoff_delay") is backoff_delay
    with pytest.raises(ConfigurationError, match="module:function"):
        load_handler("outbox.consumer")
    with pytest.raises(ConfigurationError, match="cannot import"):
        load_handler("no_such_module_xyz:f")
    with pytest.raises(ConfigurationError, match="no attribute"):
        load_handler("outbox.consumer:nope")
    with pytest.raises(ConfigurationError, match="not callable"):
        load_handler("outbox.consumer:ENV_GROUP")


def test_runner_turns_a_refused_kafka_config_into_a_configuration_error() -> None:
    from outbox import Outbox
    from outbox.consumer import ConsumerRunner

    ob = Outbox("postgresql+psycopg://nobody@127.0.0.1:1/none")  # no I/O until used
    runner = ConsumerRunner(ob, lambda uow, message: None, topics=["orders"], group="g",
                            bootstrap_servers="127.0.0.1:1",
                            kafka_config={"no.such.property": "1"})  # fmt: skip
    with pytest.raises(ConfigurationError, match="refused the configuration"):
        runner.run()
    ob.close()


def test_runner_refuses_a_handler_that_is_not_callable() -> None:
    from outbox import Outbox
    from outbox.consumer import ConsumerRunner

    ob = Outbox("postgresql+psycopg://nobody@127.0.0.1:1/none")
    with pytest.raises(ConfigurationError, match="callable"):
        ConsumerRunner(ob, "handler", topics=["orders"], group="g",  # type: ignore[arg-type]
                       bootstrap_servers="k:1")  # fmt: skip
    ob.close()


def test_database_outages_are_told_apart_from_failed_statements() -> None:
    import psycopg
    import sqlalchemy as sa

    from outbox._pg.errors import database_unavailable

    refused: BaseException | None = None
    try:  # a real failed connection attempt: nothing listens on port 9
        psycopg.connect("host=127.0.0.1 port=9 connect_timeout=2")
    except psycopg.OperationalError as exc:
        refused = exc
    assert refused is not None
    assert database_unavailable(refused)  # no SQLSTATE; the failed attempt's connection attached
    assert database_unavailable(sa.exc.OperationalError("connect", {}, refused))
    lost = psycopg.OperationalError("consuming input failed: server closed the connection")
    assert database_unavailable(
        sa.exc.OperationalError("SELECT 1", {}, lost, connection_invalidated=True)
    )
    assert database_unavailable(psycopg.errors.AdminShutdown("terminating connection"))
    assert database_unavailable(psycopg.errors.ConnectionFailure("gone"))  # class 08
    assert database_unavailable(sa.exc.TimeoutError("QueuePool limit reached"))
    gone = sa.exc.DBAPIError("SELECT 1", {}, Exception("x"), connection_invalidated=True)
    assert database_unavailable(gone)
    # A client-side failure of a healthy connection is not an outage.
    too_many = psycopg.OperationalError("sending query and params failed: too many parameters")
    assert not database_unavailable(too_many)
    assert not database_unavailable(sa.exc.OperationalError("INSERT", {}, too_many))
    # The server ended the session over the work itself: counted against the message.
    idle = psycopg.errors.IdleInTransactionSessionTimeout("terminating connection: idle")
    assert not database_unavailable(
        sa.exc.OperationalError("SELECT 1", {}, idle, connection_invalidated=True)
    )
    # A statement the server refused is the message's business, not an outage.
    assert not database_unavailable(psycopg.errors.DeadlockDetected("deadlock detected"))
    assert not database_unavailable(psycopg.errors.QueryCanceled("statement timeout"))
    unique = psycopg.errors.UniqueViolation("duplicate key")
    assert not database_unavailable(sa.exc.IntegrityError("INSERT", {}, unique))
    assert not database_unavailable(ValueError("bad payload"))


def test_each_runner_takes_handlers_and_outboxes_of_its_flavour() -> None:
    import functools
    import inspect

    from outbox import AsyncOutbox, Outbox
    from outbox._core.handlers import is_coroutine_handler
    from outbox.consumer import AsyncConsumerRunner, ConsumerRunner, consume
    from outbox.consumer._runner_async import consume as consume_async

    def plain(uow: Any, message: Any) -> None:
        return None

    async def coroutine(uow: Any, message: Any) -> None:
        return None

    class Callable:
        async def __call__(self, uow: Any, message: Any) -> None:
            return None

    assert is_coroutine_handler(coroutine)
    assert is_coroutine_handler(functools.partial(coroutine))
    assert is_coroutine_handler(Callable())
    assert not is_coroutine_handler(plain)
    assert not is_coroutine_handler(lambda uow, message: None)
    assert inspect.iscoroutinefunction(consume_async) and not inspect.iscoroutinefunction(consume)

    settings: dict[str, Any] = {"topics": ["orders"], "group": "g", "bootstrap_servers": "k:1"}
    url = "postgresql+psycopg://nobody@127.0.0.1:1/none"  # nothing connects
    ob, aob = Outbox(url), AsyncOutbox(url)
    try:
        assert isinstance(ConsumerRunner(ob, plain, **settings), ConsumerRunner)
        for handler in (coroutine, Callable()):
            assert isinstance(AsyncConsumerRunner(aob, handler, **settings), AsyncConsumerRunner)
        with pytest.raises(ConfigurationError, match="ConsumerRunner runs plain functions"):
            ConsumerRunner(ob, coroutine, **settings)
        with pytest.raises(ConfigurationError, match="AsyncConsumerRunner runs coroutine"):
            AsyncConsumerRunner(aob, plain, **settings)
        with pytest.raises(ConfigurationError, match=r"outbox of its flavour \(sync\)"):
            ConsumerRunner(aob, plain, **settings)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match=r"outbox of its flavour \(asyncio\)"):
            AsyncConsumerRunner(ob, coroutine, **settings)  # type: ignore[arg-type]
    finally:
        ob.close()
        asyncio.run(aob.close())


def test_the_sync_module_offers_both_runners() -> None:
    import outbox.consumer

    assert "AsyncConsumerRunner" in outbox.consumer.__all__
    assert "ConsumerRunner" in outbox.consumer.__all__


def test_a_guarded_runner_runs_one_message_at_a_time_with_claim_handlers() -> None:
    from outbox.consumer import AsyncConsumerRunner, ConsumerRunner, batch_handler
    from outbox.guard import AsyncRedisGuard, RedisGuard

    settings: dict[str, Any] = {"topics": ["orders"], "group": "g", "bootstrap_servers": "k:1"}
    url = "redis://127.0.0.1:1/0"  # nothing connects
    guard, aguard = RedisGuard(url), AsyncRedisGuard(url)

    def plain(claim: Any, message: Any) -> None:
        return None

    async def coroutine(claim: Any, message: Any) -> None:
        return None

    try:
        runner = ConsumerRunner(guard, plain, **settings)
        assert runner.guard is guard and runner.outbox is None
        assert runner.config.batch_size == 1  # the default under a guard
        arunner = AsyncConsumerRunner(aguard, coroutine, **settings)
        assert arunner.guard is aguard and arunner.config.batch_size == 1
        assert ConsumerRunner(guard, plain, ConsumerConfig(batch_size=1, **settings)).guard
        with pytest.raises(ConfigurationError, match="batch_size must be 1, got 500"):
            ConsumerRunner(guard, plain, ConsumerConfig(**settings))
        with pytest.raises(ConfigurationError, match="batch_size must be 1, got 2"):
            AsyncConsumerRunner(aguard, coroutine, batch_size=2, **settings)
        with pytest.raises(ConfigurationError, match="not a @batch_handler"):
            ConsumerRunner(guard, batch_handler(lambda batch: None), **settings)
        with pytest.raises(ConfigurationError, match=r"handler\(claim, message\)"):
            ConsumerRunner(guard, coroutine, **settings)
        with pytest.raises(ConfigurationError, match=r"outbox of its flavour \(sync\)"):
            ConsumerRunner(aguard, plain, **settings)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match=r"outbox of its flavour \(asyncio\)"):
            AsyncConsumerRunner(guard, coroutine, **settings)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="RedisGuard, got str"):
            ConsumerRunner(url, plain, **settings)  # type: ignore[arg-type]
    finally:
        guard.close()
        asyncio.run(aguard.aclose())


def test_a_message_built_without_a_broker_reads_like_a_received_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from outbox._kafka import consumer as kafka_consumer

    built = [kafka_consumer.make_message("t", 1, 7, b"k", b"v", [("X-Idempotency-Key", b"id")])]

    def refuse(**_: Any) -> None:  # a client that cannot build a Message (before 2.13)
        raise TypeError("cannot create 'cimpl.Message' instances")

    monkeypatch.setattr(kafka_consumer, "Message", refuse)
    built.append(kafka_consumer.make_message("t", 1, 7, b"k", b"v", [("X-Idempotency-Key", b"id")]))
    for message in built:
        assert (message.topic(), message.partition(), message.offset()) == ("t", 1, 7)
        assert (message.key(), message.value(), message.error()) == (b"k", b"v", None)
        assert header_key(message, "X-Idempotency-Key") == "id"
        assert message_headers(message) == [("X-Idempotency-Key", b"id")]


def test_the_faces_earlier_names_still_import_but_are_not_its_api() -> None:
    import outbox.consumer
    from outbox.config import ENV_CONSUMER_GROUP
    from outbox.consumer import (  # type: ignore[attr-defined]
        ENV_GROUP,
        backoff_delay as earlier_backoff,  # type: ignore[attr-defined]
        database_unavailable,
    )

    assert earlier_backoff is backoff_delay and ENV_GROUP == ENV_CONSUMER_GROUP
    assert callable(database_unavailable)
    earlier = {
        "ENV_GROUP",
        "ENV_KAFKA_CONFIG",
        "ENV_METRICS_PORT",
        "backoff_delay",
        "database_unavailable",
        "header_key",
    }
    assert not earlier & set(outbox.consumer.__all__)
    with pytest.raises(AttributeError, match="no attribute 'never_was'"):
        outbox.consumer.never_was  # type: ignore[attr-defined]  # noqa: B018


def test_the_attempts_verdict_keeps_its_earlier_name() -> None:
    from outbox.consumer import AttemptVerdict, Outcome  # type: ignore[attr-defined]

    assert Outcome is AttemptVerdict and AttemptVerdict.PROCESSED == "processed"
