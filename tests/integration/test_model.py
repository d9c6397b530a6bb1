"""A model of the whole, checked against the real services step by step.

A Hypothesis state machine drives units of work (completing, failing permanently, failing
transiently), duplicates, an attempt that meets a running one, Redis flushes, garbage and
forged entries, relay runs and Kafka deliveries to a running consumer runner, in any order.
A plain Python model says what each step must do; after every step the model and reality must
agree on:

* every outcome (result, replay, ``KeyInProgress``, ``PreviouslyFailed``);
* the rows: ``idempotency_keys`` (key and status), the business table (one row per effect),
  ``outbox`` (the events not relayed yet);
* Redis: every entry the cache would trust holds the model's outcome;
* Kafka: the relayed topic holds every relayed event and nothing else.

The short run (``dev``/``ci`` profiles) is part of ``make test``; ``HYPOTHESIS_PROFILE=long``
runs ten times as many sequences, each longer.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from hypothesis import settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from prometheus_client import CollectorRegistry

import outbox
from outbox import OutboxConfig, PermanentError
from outbox._core.claim import STATUS_COMPLETED, STATUS_FAILED, StoredOutcome
from outbox._redis.entry import decode_entry, derive_key, encode_entry
from outbox.config import RelayConfig
from outbox.consumer import ConsumerRunner
from outbox.errors import KeyInProgress, PreviouslyFailed
from outbox.relay import Relay
from tests.fixtures.common import wait_for
from tests.fixtures.consumer import KAFKA, Running, keyed, produce
from tests.fixtures.kafka import create_topic
from tests.fixtures.relay import assert_delivered, read_topic
from tests.fixtures.uow import INSERT_ORDER, create_orders

SCOPE = "model"
KEYS = st.sampled_from([f"k{i}" for i in range(6)])
MESSAGE_KEYS = st.sampled_from([f"m{i}" for i in range(4)])


@dataclass
class Services:
    """What one test's state machines share: the database, Redis, the broker, the runner."""

    engine: sa.Engine
    ob: outbox.Outbox
    client: redis.Redis
    prefix: str
    database_url: str
    bootstrap: str
    input_topic: str
    group: str
    running: Running
    delivered_messages: int = 0


@dataclass
class Model:
    """What the toolkit must have done, in plain Python."""

    outcomes: dict[tuple[str, str], tuple[str, Any]] = field(default_factory=dict)
    pending: set[str] = field(default_factory=set)  # event ids still in the outbox
    relayed: set[str] = field(default_factory=set)  # event ids that must be in Kafka
    runs: int = 0


class Transient(Exception):
    """A failure that leaves the key free."""


class OutboxMachine(RuleBasedStateMachine):
    services: Services  # set by the test before the machine runs

    def __init__(self) -> None:
        super().__init__()
        self.s = type(self).services
        self.model = Model()
        self.output_topic = f"model.out.{uuid.uuid4().hex[:10]}"
        self.kafka_checked: set[str] = set()

    @initialize()
    def reset(self) -> None:
        with self.s.engine.begin() as conn:
            conn.execute(sa.text("TRUNCATE idempotency_keys, outbox, orders"))
        for key in self.s.client.scan_iter(match=f"{self.s.prefix}*", count=1000):
            self.s.client.delete(key)

    # -- units of work --------------------------------------------------------------------

    def _body(self, uow: outbox.UnitOfWork, key: str, kind: str) -> Any:
        uow.connection.execute(INSERT_ORDER, {"k": key, "a": 1})
        event_id = uow.publish(self.output_topic, {"key": key}, key=key)
        if kind == "permanent":
            raise PermanentError(f"refused {key}")
        if kind == "transient":
            raise Transient(key)
        self.model.runs += 1
        uow.result = {"key": key, "run": self.model.runs}
        self._published = str(event_id)
        return uow.result

    def _expect(self, key: str, scope: str = SCOPE) -> tuple[str, Any] | None:
        return self.model.outcomes.get((scope, key))

    @rule(key=KEYS, kind=st.sampled_from(["ok", "ok", "permanent", "transient"]))
    def unit_of_work(self, key: str, kind: str) -> None:
        expected = self._expect(key)
        self._published = ""
        try:
            with self.s.ob.unit_of_work(key, scope=SCOPE) as uow:
                if uow.replayed:
                    assert expected is not None and expected[0] == STATUS_COMPLETED
                    assert uow.result == expected[1]
                    return
                assert expected is None, f"{key} ran again after {expected}"
                result = self._body(uow, key, kind)
        except PreviouslyFailed as exc:
            assert expected is not None and expected[0] == STATUS_FAILED
            assert exc.error == expected[1]
            return
        except PermanentError:
            assert expected is None and kind == "permanent"
            self.model.outcomes[(SCOPE, key)] = (STATUS_FAILED, f"PermanentError: refused {key}")
            return
        except Transient:
            assert expected is None and kind == "transient"
            return
        assert kind == "ok"
        self.model.outcomes[(SCOPE, key)] = (STATUS_COMPLETED, result)
        self.model.pending.add(self._published)

    @rule(key=KEYS)
    def attempt_meets_a_running_one(self, key: str) -> None:
        if self._expect(key) is not None:
            return  # nothing would run: covered by unit_of_work
        entered, release = threading.Event(), threading.Event()
        errors: list[BaseException] = []

        def holder() -> None:
            try:
                with self.s.ob.unit_of_work(key, scope=SCOPE) as uow:
                    self._body(uow, key, "ok")
                    entered.set()
                    assert release.wait(20)
            except BaseException as exc:
                errors.append(exc)
                entered.set()

        thread = threading.Thread(target=holder)
        thread.start()
        try:
            assert entered.wait(20)
            with pytest.raises(KeyInProgress), self.s.ob.unit_of_work(key, scope=SCOPE):
                raise AssertionError("the second attempt ran")
        finally:
            release.set()
            thread.join(30)
        assert errors == []
        self.model.outcomes[(SCOPE, key)] = (
            STATUS_COMPLETED,
            {"key": key, "run": self.model.runs},
        )
        self.model.pending.add(self._published)

    # -- Redis ----------------------------------------------------------------------------

    @rule()
    def flush_redis(self) -> None:
        for key in self.s.client.scan_iter(match=f"{self.s.prefix}*", count=1000):
            self.s.client.delete(key)

    @rule(
        key=KEYS,
        garbage=st.one_of(
            st.binary(max_size=200),
            st.integers(1, 20_000).map(lambda d: b"[" * d + b"]" * d),
        ),
    )
    def garbage_in_redis(self, key: str, garbage: bytes) -> None:
        assert self.s.ob.cache is not None
        self.s.client.set(self.s.ob.cache.redis_key(SCOPE, key), garbage)

    @rule(key=KEYS, signed=st.booleans())
    def forged_entry(self, key: str, signed: bool) -> None:
        """A completed entry for the key, from a writer that has only Redis."""
        assert self.s.ob.cache is not None
        redis_key = self.s.ob.cache.redis_key(SCOPE, key)
        forged_result = json.dumps({"key": key, "run": -1})
        if signed:
            value = encode_entry(
                StoredOutcome(STATUS_COMPLETED, None, forged_result, None),
                derive_key(b"guessed" * 5, 1, 1, 1, 1),
                redis_key,
                int(time.time() * 1000) + 60_000,
            )
            assert value is not None
        else:
            value = json.dumps({"s": "completed", "f": None, "r": forged_result}).encode()
        self.s.client.set(redis_key, value)

    # -- the relay and the consumer runner --------------------------------------------------

    @precondition(lambda self: bool(self.model.pending))
    @rule()
    def relay_runs(self) -> None:
        config = RelayConfig(self.s.database_url, self.s.bootstrap, lanes=4, poll_interval=0.2)
        Relay(config).run(once=True)
        self.model.relayed |= self.model.pending
        self.model.pending = set()

    @rule(key=MESSAGE_KEYS, copies=st.integers(1, 3))
    def consumer_delivery(self, key: str, copies: int) -> None:
        produce(self.s.bootstrap, self.s.input_topic, [keyed(key, key) for _ in range(copies)])
        self.s.delivered_messages += copies
        wanted = self.s.delivered_messages
        wait_for(lambda: self._finished() >= wanted, 30, f"runner finished {wanted} messages")
        assert self._finished() == wanted
        expected = self._expect(key, self.s.group)
        if expected is None:
            self.model.outcomes[(self.s.group, key)] = (STATUS_COMPLETED, {"handled": key})

    def _finished(self) -> int:
        registry: CollectorRegistry = self.s.running.registry
        labels = {"group": self.s.group, "topic": self.s.input_topic}
        processed = registry.get_sample_value("outbox_consumer_processed_total", labels) or 0
        replayed = (
            registry.get_sample_value(
                "outbox_consumer_replayed_total", {**labels, "status": "completed"}
            )
            or 0
        )
        return int(processed + replayed)

    # -- what must hold after every step ------------------------------------------------------

    @invariant()
    def rows_agree(self) -> None:
        with self.s.engine.connect() as conn:
            keys = {
                (scope, key): status
                for scope, key, status in conn.execute(
                    sa.text("SELECT scope, key, status FROM idempotency_keys")
                )
            }
            effects = {
                key: n
                for key, n in conn.execute(
                    sa.text("SELECT order_key, count(*) FROM orders GROUP BY order_key")
                )
            }
            pending = {str(row[0]) for row in conn.execute(sa.text("SELECT event_id FROM outbox"))}
        assert keys == {k: v[0] for k, v in self.model.outcomes.items()}
        completed = {k for (_, k), v in self.model.outcomes.items() if v[0] == STATUS_COMPLETED}
        assert effects == dict.fromkeys(completed, 1)
        assert pending == self.model.pending

    @invariant()
    def trusted_redis_entries_agree(self) -> None:
        cache = self.s.ob.cache
        assert cache is not None
        mac_key = cache._signer
        if mac_key is None:
            return
        now = int(time.time() * 1000)
        never_ran = [(SCOPE, f"k{i}") for i in range(6)] + [
            (self.s.group, f"m{i}") for i in range(4)
        ]
        expected = {k: ("-", None) for k in never_ran} | self.model.outcomes
        for (scope, key), (status, value) in expected.items():
            redis_key = cache.redis_key(scope, key)
            outcome = decode_entry(self.s.client.get(redis_key), mac_key, redis_key, now)
            if outcome is None:
                continue
            assert outcome.status == status, (scope, key, outcome)
            if status == STATUS_COMPLETED:
                assert json.loads(outcome.result_json or "null") == value
            else:
                assert outcome.error == value

    @invariant()
    def kafka_holds_the_relayed_events(self) -> None:
        if self.model.relayed == self.kafka_checked:
            return  # only a relay run writes to the topic
        records = read_topic(self.s.bootstrap, self.output_topic)
        assert_delivered(records, self.model.relayed)
        self.kafka_checked = set(self.model.relayed)


@pytest.fixture
def services(
    engine: sa.Engine, database_url: str, redis_url: str, redis_prefix: str, kafka_bootstrap: str
) -> Iterator[Services]:
    create_orders(engine)
    client = redis.Redis.from_url(redis_url)
    ob = outbox.Outbox(engine, redis=client, config=OutboxConfig(cache_prefix=redis_prefix))
    input_topic = f"model.in.{uuid.uuid4().hex[:10]}"
    create_topic(kafka_bootstrap, input_topic, partitions=2)
    group = f"model-{uuid.uuid4().hex[:8]}"

    def handle(uow: outbox.UnitOfWork, message: Any) -> dict[str, str]:
        key = message.value().decode()
        uow.connection.execute(INSERT_ORDER, {"k": key, "a": 1})
        return {"handled": key}

    registry = CollectorRegistry()
    runner = ConsumerRunner(
        ob, handle, topics=[input_topic], group=group, bootstrap_servers=kafka_bootstrap,
        kafka_config=KAFKA, metrics_registry=registry,
    )  # fmt: skip
    running = Running(runner, registry)
    try:
        yield Services(
            engine, ob, client, redis_prefix, database_url, kafka_bootstrap, input_topic, group,
            running,
        )  # fmt: skip
    finally:
        running.stop()
        ob.close()
        client.close()


def test_the_model_and_the_services_agree(services: Services) -> None:
    OutboxMachine.services = services
    steps = 14 if settings.default.max_examples <= 100 else 40
    run_state_machine_as_test(
        OutboxMachine,
        settings=settings(
            max_examples=max(1, settings.default.max_examples // 20),
            stateful_step_count=steps,
        ),
    )
