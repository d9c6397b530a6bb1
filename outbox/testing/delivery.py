"""Consumer handlers run for a message as the runner would (no broker), and one relay run."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from outbox._core import codec, results
from outbox._core.deadletter import DeadLetter
from outbox._core.disposition import AttemptVerdict
from outbox._core.environment import ENV_KAFKA_BOOTSTRAP
from outbox._core.handlers import BATCH_HANDLER, is_coroutine_handler
from outbox._core.offsets import Tries
from outbox._kafka.consumer import header_key, make_message
from outbox.config import ConsumerConfig
from outbox.consumer import AsyncAttempts, Attempts, ConsumerMetrics
from outbox.relay import BatchResult, Relay, RelayConfig
from outbox.schema import tables
from outbox.testing.databases import ENV_TESTING_BOOTSTRAP
from outbox.uow import AsyncOutbox, Outbox


@dataclass(frozen=True)
class Delivery:
    """What became of one delivery of a message (see :class:`Deliverer`).

    ``outcome`` is the runner's verdict: ``"processed"`` (the handler ran, its unit of work
    committed), ``"replayed"`` (a duplicate: the stored result, the handler skipped),
    ``"previously_failed"`` (the key had failed permanently before), ``"dead_lettered"`` or
    ``"retry"`` (the runner would try the message again after a backoff). ``result`` is the
    result stored with the key (processed or replayed); ``dead_letter`` what the dead letter
    says (reason, error, error type, attempts); ``error`` what the handler raised, if it did.
    """

    outcome: str
    key: str | None
    result: Any
    replayed: bool
    dead_letter: DeadLetter | None
    error: BaseException | None
    message: Any = field(repr=False)

    @property
    def processed(self) -> bool:
        return self.outcome == AttemptVerdict.PROCESSED

    @property
    def dead_lettered(self) -> bool:
        return self.outcome == AttemptVerdict.DEAD_LETTERED


class _DeadLetters:
    """The dead-letter producer of :class:`Deliverer`: keeps the dead letters it is given."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, DeadLetter]] = []

    def send_message(self, message: Any, letter: DeadLetter) -> None:
        self.sent.append((message, letter))


class _AsyncDeadLetters:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, DeadLetter]] = []

    async def send_message(self, message: Any, letter: DeadLetter) -> None:
        self.sent.append((message, letter))


# until_done: retries that do not count an attempt (a busy key, an outage) give up after these.
_MAX_WAITS = 20


def _bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    return json.dumps(value).encode("utf-8")


class Deliverer:
    """Runs a consumer handler for one message the way the consumer runner does -- the same
    code: the key read from the ``X-Idempotency-Key`` header, the real unit of work, the same
    verdicts (:mod:`outbox._core.disposition`) -- without a broker. Dead letters are kept in
    :attr:`dead_letters` instead of being produced.

    ``deliver(handler, value, key=None, headers=None, topic="test")`` delivers one message:
    ``value`` and ``key`` as bytes, text, or (value) JSON-encoded data. Each message gets a new
    idempotency key unless ``idempotency_key=`` or an ``X-Idempotency-Key`` header names one:
    delivering the same key again is a redelivery. ``attempts=`` counts earlier failed
    attempts (to reach ``max_attempts``); ``until_done=True`` retries a message the way the
    runner would (without the backoff's wait) until it is finished, and fails the test with an
    ``AssertionError`` after 20 retries that count no attempt (its key held by a unit of work
    still open, or the database down), where the runner would wait. A coroutine handler runs on
    the asyncio runner's code, in an event loop of its own.
    """

    def __init__(
        self,
        outbox: Outbox,
        *,
        group: str = "tests",
        scope: str | None = None,
        max_attempts: int = 5,
        key_header: str = codec.IDEMPOTENCY_HEADER,
    ) -> None:
        self.outbox = outbox
        self.config = ConsumerConfig(
            topics=("test",),
            group=group,
            scope=scope,
            # Required by the configuration, never connected to: no Kafka client is built.
            bootstrap_servers="127.0.0.1:9092",
            key_header=key_header,
            max_attempts=max_attempts,
        ).validate()
        self._metrics = ConsumerMetrics(CollectorRegistry())
        self._offsets: dict[tuple[str, int], int] = {}
        self.dead_letters: list[tuple[Any, DeadLetter]] = []

    def message(
        self,
        value: Any,
        *,
        key: str | bytes | None = None,
        headers: Mapping[str, str | bytes] | None = None,
        topic: str = "test",
        partition: int = 0,
        idempotency_key: str | None = None,
    ) -> Any:
        """A Kafka message as the runner receives it (its offset the next of its partition)."""
        pairs = [(name, _bytes(v)) for name, v in (headers or {}).items()]
        wanted = self.config.key_header.lower()
        if idempotency_key is not None:
            pairs = [(n, v) for n, v in pairs if n.lower() != wanted]
            pairs.append((self.config.key_header, idempotency_key.encode("utf-8")))
        elif not any(n.lower() == wanted for n, _ in pairs):
            pairs.append((self.config.key_header, uuid.uuid4().hex.encode("ascii")))
        offset = self._offsets.get((topic, partition), 0)
        self._offsets[(topic, partition)] = offset + 1
        key_bytes = key.encode("utf-8") if isinstance(key, str) else key
        return make_message(topic, partition, offset, key_bytes, _bytes(value), pairs)

    def __call__(
        self,
        handler: Callable[..., Any],
        value: Any = None,
        *,
        key: str | bytes | None = None,
        headers: Mapping[str, str | bytes] | None = None,
        topic: str = "test",
        idempotency_key: str | None = None,
        attempts: int = 0,
        until_done: bool = False,
        message: Any = None,
    ) -> Delivery:
        if message is None:
            message = self.message(
                value, key=key, headers=headers, topic=topic, idempotency_key=idempotency_key
            )
        tries = Tries(attempts=attempts)
        raised: list[BaseException] = []
        watched = _watched(handler, raised)
        while True:
            if is_coroutine_handler(handler):
                outcome, letters = asyncio.run(self._apply_async(watched, message, tries))
            else:
                dlq = _DeadLetters()
                attempt = Attempts(
                    self.outbox, watched, self.config, self._metrics,
                    dlq=dlq, key_func=None, fingerprint_func=None, beat=_nothing,
                )  # fmt: skip
                outcome = attempt.apply(message, tries)
                letters = dlq.sent
            self.dead_letters.extend(letters)
            if outcome is not AttemptVerdict.RETRY or not until_done:
                break
            if tries.waits >= _MAX_WAITS:
                raise AssertionError(
                    f"deliver(until_done=True): the message was retried {tries.waits} times "
                    "without an attempt that counts: its key is held by another attempt (a "
                    "unit of work still open?) or the database does not answer"
                )
        return self._delivery(outcome, message, tries, letters, raised)

    async def _apply_async(
        self, handler: Callable[..., Any], message: Any, tries: Tries
    ) -> tuple[AttemptVerdict, list[tuple[Any, DeadLetter]]]:
        url = self.outbox.engine.url.render_as_string(hide_password=False)
        async with AsyncOutbox(url, config=self.outbox.config) as aob:
            dlq = _AsyncDeadLetters()
            attempt = AsyncAttempts(
                aob, handler, self.config, self._metrics,
                dlq=dlq, key_func=None, fingerprint_func=None, beat=_nothing,
            )  # fmt: skip
            return await attempt.apply(message, tries), dlq.sent

    def _delivery(
        self,
        outcome: AttemptVerdict,
        message: Any,
        tries: Tries,
        letters: list[tuple[Any, DeadLetter]],
        raised: list[BaseException],
    ) -> Delivery:
        key = header_key(message, self.config.key_header)
        result = None
        if key is not None and outcome in (AttemptVerdict.PROCESSED, AttemptVerdict.REPLAYED):
            result = self._stored_result(key)
        letter = letters[-1][1] if letters else tries.dead_letter
        return Delivery(
            outcome=str(outcome),
            key=key,
            result=result,
            replayed=outcome is AttemptVerdict.REPLAYED,
            dead_letter=letter if outcome is AttemptVerdict.DEAD_LETTERED else None,
            error=raised[-1] if raised else None,
            message=message,
        )

    def _stored_result(self, key: str) -> Any:
        t = tables(self.outbox.config.schema).idempotency_keys
        query = sa.select(t.c.result).where(
            t.c.scope == self.config.effective_scope, t.c.key == key
        )
        with self.outbox.engine.connect() as conn:
            return results.decoded_from_database(conn.execute(query).scalar_one_or_none())

    def deliver_many(
        self,
        handler: Callable[..., Any],
        values: Iterable[Any],
        *,
        times: int = 3,
        topic: str = "test",
        key: Callable[[Any], str | bytes | None] | None = None,
    ) -> list[Delivery]:
        """Deliver each of ``values`` ``times`` times (every message once, then each again,
        as a redelivery after a crash or a rebalance would), each message under an
        idempotency key of its own; returns every delivery in order. ``key`` computes a
        message key from a value."""
        messages = [
            (value, uuid.uuid4().hex, key(value) if key is not None else None) for value in values
        ]
        deliveries = []
        for _ in range(times):
            for value, idempotency_key, message_key in messages:
                deliveries.append(
                    self(
                        handler,
                        value,
                        key=message_key,
                        topic=topic,
                        idempotency_key=idempotency_key,
                    )
                )
        return deliveries


def _nothing() -> None:
    pass


def _watched(handler: Callable[..., Any], raised: list[BaseException]) -> Callable[..., Any]:
    """``handler``, noting what it raises."""
    if is_coroutine_handler(handler):

        async def watched_async(*args: Any) -> Any:
            try:
                return await handler(*args)
            except BaseException as exc:
                raised.append(exc)
                raise

        watched: Callable[..., Any] = watched_async
    else:

        def watched_sync(*args: Any) -> Any:
            try:
                return handler(*args)
            except BaseException as exc:
                raised.append(exc)
                raise

        watched = watched_sync
    if getattr(handler, BATCH_HANDLER, False):
        setattr(watched, BATCH_HANDLER, True)
    return watched


def relay_outbox(database_url: str, bootstrap_servers: str | None = None, **config: Any) -> int:
    """Run the relay once over the outbox of ``database_url``: every deliverable event goes to
    the broker, confirmed, and leaves the outbox. Returns how many Kafka confirmed.

    ``config`` takes further :class:`~outbox.relay.RelayConfig` fields."""
    bootstrap = (
        bootstrap_servers
        or os.environ.get(ENV_TESTING_BOOTSTRAP)
        or os.environ.get(ENV_KAFKA_BOOTSTRAP)
    )
    if not bootstrap:
        raise pytest.UsageError(
            f"relay_once needs a Kafka broker: set {ENV_TESTING_BOOTSTRAP} (or "
            f"{ENV_KAFKA_BOOTSTRAP}), or pass bootstrap_servers="
        )
    relay = Relay(RelayConfig(database_url, bootstrap, **config))
    relay.run(once=True)
    totals: BatchResult = relay.totals
    return totals.confirmed


def assert_one_effect_per_key(
    keys: Iterable[Hashable], expected: Iterable[Hashable] | None = None
) -> None:
    """Assert that every key occurs exactly once in ``keys`` (one per effect: the rows a
    handler wrote, the events it published...) and, with ``expected``, that exactly those
    keys occur."""
    counts = Counter(keys)
    repeated = {k: n for k, n in counts.items() if n > 1}
    problems = []
    if repeated:
        problems.append(f"more than one effect for {len(repeated)} key(s): {repeated!r}")
    if expected is not None:
        wanted = set(expected)
        missing = wanted - set(counts)
        extra = set(counts) - wanted
        if missing:
            problems.append(f"no effect for {', '.join(sorted(map(repr, missing)))}")
        if extra:
            problems.append(f"effects for unexpected keys {', '.join(sorted(map(repr, extra)))}")
    if problems:
        raise AssertionError("; ".join(problems))
