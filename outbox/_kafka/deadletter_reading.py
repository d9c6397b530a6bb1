"""Reading a dead-letter topic whole and producing redriven messages (``outbox dlq``).

The topic is read with an assigned consumer (no group, nothing committed) from each partition's
beginning to the end the broker reports while reading. The
redrive producer is idempotent with ``acks=all`` and waits for every confirmation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

from outbox._core.deadletter import DeadLetterInfo
from outbox._core.deadletter_reading import Letter
from outbox._kafka.config import producer_config
from outbox.errors import OutboxError, PublishError


@dataclass(frozen=True)
class LetterPage:
    """Records read from a dead-letter topic, and where reading stopped."""

    letters: list[Letter]
    # partition -> the offset to go on from, for each partition not read to its end; empty when
    # every partition read was read to its end.
    stopped: dict[int, int]


def read_letters(
    bootstrap: str, overrides: Mapping[str, Any], topic: str, limit: int, timeout: float = 30.0
) -> list[Letter]:
    """Up to ``limit`` records of ``topic``, oldest offsets first per partition."""
    return read_letter_page(bootstrap, overrides, topic, limit, timeout=timeout).letters


def read_letter_page(
    bootstrap: str,
    overrides: Mapping[str, Any],
    topic: str,
    limit: int,
    *,
    start: Mapping[int, int] | None = None,
    counts: Callable[[int, int], bool] | None = None,
    timeout: float = 30.0,
) -> LetterPage:
    """Records of ``topic`` until ``limit`` of them count (``counts(partition, offset)``,
    default every one), partition after partition in order, each from its ``start`` offset
    (default: every partition from its beginning; given, only the partitions it names).

    One partition at a time, so that the same topic gives the same page: a record that does
    not count (a handled dead letter) is read and kept but uses none of the budget.
    """
    config = {k: v for k, v in overrides.items()}
    config.update(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "outbox-dlq-reader",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            # A position retention already deleted goes on from the oldest record kept.
            "auto.offset.reset": "earliest",
        }
    )
    consumer = Consumer(config)
    try:
        metadata = consumer.list_topics(topic, timeout=timeout)
        found = metadata.topics.get(topic)
        if found is None or found.error is not None or not found.partitions:
            raise OutboxError(f"dead-letter topic {topic!r} does not exist on the broker")
        if start is None:
            todo = {p: OFFSET_BEGINNING for p in found.partitions}
        else:
            unknown = sorted(set(start) - set(found.partitions))
            if unknown:
                raise OutboxError(
                    f"dead-letter topic {topic!r} has no partition {unknown[0]} "
                    f"(it has {len(found.partitions)})"
                )
            todo = dict(start)
        letters: list[Letter] = []
        stopped: dict[int, int] = {}
        used = 0
        deadline = time.monotonic() + timeout
        for partition in sorted(todo):
            if used >= limit:
                stopped[partition] = max(0, todo[partition])
                continue
            # Read to the partition's end as the fetch responses report it (end-of-partition
            # events); a ListOffsets answer is not trusted, some brokers answer it too low.
            consumer.assign([TopicPartition(topic, partition, todo[partition])])
            while True:
                if time.monotonic() > deadline:
                    raise OutboxError(f"reading {topic!r} did not finish within {timeout:g} s")
                message = consumer.poll(0.5)
                if message is None or message.partition() != partition:
                    continue
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        break
                    raise OutboxError(f"reading {topic!r}: {error.str()}")
                offset = message.offset()
                if offset is None:
                    continue
                if used >= limit:
                    # The budget is spent and this partition has more: go on from here.
                    stopped[partition] = offset
                    break
                letters.append(_letter(message, partition, offset))
                if counts is None or counts(partition, offset):
                    used += 1
        return LetterPage(sorted(letters, key=lambda x: (x.partition, x.offset)), stopped)
    finally:
        consumer.close()


def _letter(message: Any, partition: int, offset: int) -> Letter:
    raw = message.headers() or []
    pairs = list(raw.items()) if isinstance(raw, dict) else list(raw)
    headers = tuple(
        (name, value.encode() if isinstance(value, str) else (value or b""))
        for name, value in pairs
    )
    try:
        info: DeadLetterInfo | None = DeadLetterInfo.from_headers(
            [(name, value) for name, value in headers]
        )
    except (KeyError, ValueError):
        info = None
    stamp_type, stamp = message.timestamp()
    key, value = message.key(), message.value()
    return Letter(
        partition, offset, stamp if stamp_type else None,
        key.encode() if isinstance(key, str) else key,
        value.encode() if isinstance(value, str) else value,
        headers, info,
    )  # fmt: skip


def produce_all(
    bootstrap: str,
    overrides: Mapping[str, Any],
    records: Sequence[tuple[str, bytes | None, bytes | None, list[tuple[str, bytes]]]],
    timeout: float = 30.0,
) -> None:
    """Produce ``(topic, key, value, headers)`` records and wait for every confirmation."""
    producer = Producer(
        producer_config(bootstrap, overrides, purpose="dead-letter", client_id="outbox-dlq")
    )
    errors: list[str] = []

    def on_delivery(err: KafkaError | None, _msg: Any) -> None:
        if err is not None:
            errors.append(err.str())

    for topic, key, value, headers in records:
        record_headers: list[tuple[str, str | bytes | None]] = [(n, v) for n, v in headers]
        producer.produce(
            topic, value=value, key=key, headers=record_headers, on_delivery=on_delivery
        )
        producer.poll(0)
    left = producer.flush(timeout)
    if left or errors:
        raise PublishError(
            f"{left + len(errors)} of {len(records)} redriven message(s) not confirmed"
            + (f": {errors[0]}" if errors else ""),
            retriable=True,
        )
