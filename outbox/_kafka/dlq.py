"""Reading a dead-letter topic whole and producing redriven messages (``outbox dlq``).

The topic is read with an assigned consumer (no group, nothing committed) from each partition's
beginning to the end the broker reports while reading. The
redrive producer is idempotent with ``acks=all`` and waits for every confirmation.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

from outbox._core.deadletter import DeadLetterInfo
from outbox._core.dlq import Letter
from outbox._kafka.config import producer_config
from outbox.errors import OutboxError, PublishError


def read_letters(
    bootstrap: str, overrides: Mapping[str, Any], topic: str, limit: int, timeout: float = 30.0
) -> list[Letter]:
    """Up to ``limit`` records of ``topic``, oldest offsets first per partition."""
    config = {k: v for k, v in overrides.items()}
    config.update(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "outbox-dlq-reader",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    consumer = Consumer(config)
    try:
        metadata = consumer.list_topics(topic, timeout=timeout)
        found = metadata.topics.get(topic)
        if found is None or found.error is not None or not found.partitions:
            raise OutboxError(f"dead-letter topic {topic!r} does not exist on the broker")
        # Read to each partition's end as the fetch responses report it (end-of-partition
        # events); a ListOffsets answer is not trusted, some brokers answer it too low.
        ends: dict[int, int] = {p: 0 for p in found.partitions}
        letters: list[Letter] = []
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(ends)])
        deadline = time.monotonic() + timeout
        while ends and len(letters) < limit:
            if time.monotonic() > deadline:
                raise OutboxError(f"reading {topic!r} did not finish within {timeout:g} s")
            message = consumer.poll(0.5)
            if message is None:
                continue
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    ends.pop(message.partition() or 0, None)
                    continue
                raise OutboxError(f"reading {topic!r}: {error.str()}")
            partition, offset = message.partition(), message.offset()
            if partition is None or offset is None:
                continue
            if partition not in ends:
                continue
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
            letters.append(
                Letter(
                    partition, offset, stamp if stamp_type else None,
                    key.encode() if isinstance(key, str) else key,
                    value.encode() if isinstance(value, str) else value,
                    headers, info,
                )
            )  # fmt: skip
        return sorted(letters, key=lambda x: (x.partition, x.offset))
    finally:
        consumer.close()


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
