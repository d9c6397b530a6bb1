"""The consumer runner's Kafka side: a confluent-kafka consumer and what a message carries.

Invariant: partitions cross this boundary as ``(topic, partition)`` pairs and offsets to commit
as ``(topic, partition, offset)`` triples; client errors become
:class:`~outbox.errors.ConsumerError` (a configuration the client refuses,
:class:`~outbox.errors.ConfigurationError`). Messages are confluent-kafka's own: handlers get
them unchanged. The asyncio consumer makes its blocking calls on the client's own thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from outbox._core.offsets import PartitionId
from outbox._kafka.config import refused
from outbox._kafka.thread import ClientThread
from outbox.errors import ConsumerError, InvalidKeyError

__all__ = [
    "AsyncKafkaConsumer",
    "Committed",
    "KafkaConsumer",
    "Message",
    "coordinates",
    "header_key",
    "message_headers",
]

log = logging.getLogger("outbox.consumer")

# Polls that serve queued rebalance events before close() (see KafkaConsumer.close); each
# returns at once, with a record or with nothing left to serve.
_CLOSE_POLLS = 1000
# Seconds close() may take before it is left behind (see close_within).
_CLOSE_TIMEOUT = 30.0


class Committed(NamedTuple):
    """The broker's answer for one partition's offset commit (``error`` is ``None`` on success)."""

    topic: str
    partition: int
    offset: int
    error: str | None


def message_headers(message: Message) -> list[tuple[str, bytes | None]]:
    """A consumed message's headers as a list of ``(name, value)`` pairs (empty if none)."""
    raw = message.headers()
    if raw is None:
        return []
    items = raw.items() if isinstance(raw, dict) else raw
    return [
        (name, value.encode("utf-8") if isinstance(value, str) else value) for name, value in items
    ]


def coordinates(message: Message) -> tuple[str, int, int]:
    """``(topic, partition, offset)`` of a consumed message."""
    topic, partition, offset = message.topic(), message.partition(), message.offset()
    # Only records fetched from a partition reach this point, and they always carry all three.
    assert topic is not None and partition is not None and offset is not None
    return topic, partition, offset


def make_message(
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes,
    headers: Sequence[tuple[str, bytes]],
) -> Message:
    """A message as the consumer would receive it, built without a broker (``outbox.testing``):
    a confluent-kafka ``Message`` where the client lets one be built, else an object with the
    same accessors."""
    try:
        return Message(
            topic=topic,
            partition=partition,
            offset=offset,
            key=key,
            value=value,
            headers=list(headers),
        )
    except TypeError:  # clients before 2.13 cannot build a Message
        return cast(Message, _BuiltMessage(topic, partition, offset, key, value, list(headers)))


class _BuiltMessage:
    """The accessors of a received ``Message`` that the runner reads."""

    __slots__ = ("_headers", "_key", "_offset", "_partition", "_topic", "_value")

    def __init__(
        self,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes,
        headers: list[tuple[str, bytes]],
    ) -> None:
        self._topic, self._partition, self._offset = topic, partition, offset
        self._key, self._value, self._headers = key, value, headers

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes:
        return self._value

    def headers(self) -> list[tuple[str, bytes]] | None:
        return self._headers or None

    def error(self) -> None:
        return None


def header_key(message: Message, header: str) -> str | None:
    """The idempotency key from the first ``header`` header, or ``None`` if there is none.

    The name is matched without regard to case, as the relay does when it decides whether the
    publisher set the header itself. Raises :class:`~outbox.errors.InvalidKeyError` for a value
    that is not UTF-8.
    """
    wanted = header.lower()
    raw = message.headers()
    if not raw:
        return None
    for name, value in raw.items() if isinstance(raw, dict) else raw:
        if isinstance(value, str):
            value = value.encode("utf-8")  # as message_headers gives it
        if value is not None and name.lower() == wanted:
            try:
                text: str = value.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidKeyError(
                    f"header {header!r} is not UTF-8 text: {value[:40]!r}"
                ) from exc
            return text
    return None


def _pairs(partitions: Iterable[TopicPartition]) -> list[PartitionId]:
    return [(tp.topic, tp.partition) for tp in partitions]


def _committed(partitions: Iterable[TopicPartition]) -> list[Committed]:
    return [
        Committed(tp.topic, tp.partition, tp.offset, None if tp.error is None else str(tp.error))
        for tp in partitions
    ]


class KafkaConsumer:
    """A confluent-kafka consumer that speaks in partitions and offsets, not client objects.

    ``on_error(text, fatal)`` receives the client's errors (librdkafka reconnects by itself;
    a fatal one means the consumer must be rebuilt). ``on_commit(error, committed)`` receives
    the broker's answers to asynchronous commits.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        on_error: Callable[[str, bool], None],
        on_commit: Callable[[str | None, list[Committed]], None],
    ) -> None:
        def error_cb(err: KafkaError) -> None:
            on_error(str(err), err.fatal())

        def on_commit_cb(err: KafkaError | None, partitions: list[TopicPartition]) -> None:
            on_commit(None if err is None else str(err), _committed(partitions))

        try:
            self._consumer = Consumer({**config, "error_cb": error_cb, "on_commit": on_commit_cb})
        except KafkaException as exc:
            raise refused(exc, config) from exc
        self._paused: set[PartitionId] = set()

    def subscribe(
        self,
        topics: Sequence[str],
        *,
        on_assign: Callable[[list[PartitionId]], None],
        on_revoke: Callable[[list[PartitionId]], None],
        on_lost: Callable[[list[PartitionId]], None],
    ) -> None:
        """Join the group for ``topics``; the callbacks run inside :meth:`consume`.

        The callbacks leave the (incremental) assign to the client, so eager and cooperative
        assignors both work.
        """
        self._consumer.subscribe(
            list(topics),
            on_assign=lambda _c, partitions: on_assign(_pairs(partitions)),
            on_revoke=lambda _c, partitions: on_revoke(_pairs(partitions)),
            on_lost=lambda _c, partitions: on_lost(_pairs(partitions)),
        )

    def consume(self, max_messages: int, timeout: float, wait: float = 0.0) -> list[Message]:
        """Up to ``max_messages`` records: waits at most ``timeout`` seconds for the first, then
        at most ``wait`` seconds for more (librdkafka waits the whole time it is given unless
        the batch fills up, so the two waits are asked for separately).

        Error events are logged and left out (librdkafka recovers from them); a fatal one raises
        :class:`~outbox.errors.ConsumerError`.
        """
        messages = self._consume(1, timeout)
        if messages and max_messages > 1:
            messages += self._consume(max_messages - 1, wait)
        return messages

    def _consume(self, max_messages: int, timeout: float) -> list[Message]:
        try:
            batch = self._consumer.consume(max_messages, timeout)
        except KafkaException as exc:
            raise ConsumerError(f"Kafka consumer error: {exc}; restart the consumer") from exc
        messages = []
        for message in batch:
            err = message.error()
            if err is None:
                messages.append(message)
            elif err.fatal():
                raise ConsumerError(f"fatal Kafka consumer error: {err}; restart the consumer")
            elif err.code() != KafkaError._PARTITION_EOF:
                log.warning("Kafka consumer error on %s: %s", message.topic(), err)
        return messages

    def high_watermarks(self, partitions: Iterable[PartitionId]) -> dict[PartitionId, int]:
        """The high watermark of each of ``partitions`` as of the client's last fetch from it
        (no request to the broker); partitions not fetched from yet are left out."""
        highs = {}
        for topic, partition in partitions:
            try:
                _low, high = self._consumer.get_watermark_offsets(
                    TopicPartition(topic, partition), cached=True
                )
            except KafkaException:
                continue
            if high is not None and high >= 0:
                highs[(topic, partition)] = int(high)
        return highs

    def commit(self, offsets: Sequence[tuple[str, int, int]], *, sync: bool) -> list[Committed]:
        """Commit ``offsets``; a synchronous commit returns the broker's answer per partition.

        Raises :class:`~outbox.errors.ConsumerError` when the commit could not be made.
        """
        partitions = [
            TopicPartition(topic, partition, offset) for topic, partition, offset in offsets
        ]
        try:
            if sync:
                return _committed(self._consumer.commit(offsets=partitions, asynchronous=False))
            self._consumer.commit(offsets=partitions, asynchronous=True)
        except KafkaException as exc:
            raise ConsumerError(str(exc)) from exc
        return []

    def commit_now(self, offsets: Sequence[tuple[str, int, int]]) -> list[Committed]:
        """A synchronous :meth:`commit` on the calling thread: for rebalance callbacks, which
        run inside :meth:`consume` and must commit before they return."""
        return self.commit(offsets, sync=True)

    def pause(self, tp: PartitionId) -> None:
        """Stop fetching ``tp`` (if not paused already).

        Pausing drops prefetched records; :meth:`resume` continues after the last record handed
        out, so a caller that keeps what it received skips nothing.
        """
        if tp not in self._paused:
            self._call(self._consumer.pause, [tp])
            self._paused.add(tp)

    def resume(self, tp: PartitionId) -> None:
        """Fetch ``tp`` again (if it was paused)."""
        if tp in self._paused:
            self._call(self._consumer.resume, [tp])
            self._paused.discard(tp)

    def release(self, partitions: Iterable[PartitionId]) -> None:
        """Forget the pauses of ``partitions``, which left the assignment.

        A pause outlives the assignment in some client versions; it must never carry over to a
        later assignment of the same partition, so the paused ones are resumed (best effort).
        """
        paused = [tp for tp in partitions if tp in self._paused]
        self._paused.difference_update(paused)
        if paused:
            try:
                self._call(self._consumer.resume, paused)
            except ConsumerError as exc:
                log.debug("resume of revoked partitions failed: %s", exc)

    @staticmethod
    def _call(
        method: Callable[[list[TopicPartition]], None], partitions: list[PartitionId]
    ) -> None:
        try:
            method([TopicPartition(*tp) for tp in partitions])
        except KafkaException as exc:
            raise ConsumerError(str(exc)) from exc

    def check(self, timeout: float) -> bool:
        """True when a broker answered a metadata request within ``timeout`` seconds
        (readiness checks)."""
        try:
            self._consumer.list_topics(timeout=timeout)
        except (KafkaException, RuntimeError):
            return False
        return True

    def close(self) -> None:
        """Leave the group (partitions move to other members at once) and release the client.

        Rebalance events still queued are served first, by polling: librdkafka can wait
        forever when ``close()`` itself has to serve an assignment (librdkafka issue 4884), and
        confluent-kafka holds the GIL there, which would freeze every thread of the process.
        Records these polls fetch are dropped; their offsets are not committed, so the group
        reads them again. A close that still does not return within ``_CLOSE_TIMEOUT`` seconds
        is left behind (:func:`close_within`).
        """
        close_within(self._consumer, _CLOSE_TIMEOUT)


def close_within(client: Any, timeout: float, polls: int = _CLOSE_POLLS) -> bool:
    """Serve ``client``'s queued events (at most ``polls`` polls), then close it, waiting at most
    ``timeout`` seconds; True when it closed.

    librdkafka can still wait forever inside ``close()`` -- a rebalance that arrives after the
    polls -- and a runner must stop all the same: the close runs on a thread of its own, and is
    left behind (logged) when it does not return in time; the group moves the partitions once
    the member's session times out. A close that fails raises :class:`ConsumerError`.
    """
    failed: list[BaseException] = []

    def close() -> None:
        try:
            for _ in range(polls):
                if client.poll(0) is None:
                    break
            client.close()
        except BaseException as exc:  # handed to the caller below
            failed.append(exc)

    closer = threading.Thread(target=close, name="outbox-kafka-consumer-close", daemon=True)
    closer.start()
    closer.join(timeout)
    if closer.is_alive():
        log.warning(
            "event=consumer_close_stuck the Kafka client did not close within %.0fs; left "
            "behind: its partitions move to other members once its session times out",
            timeout,
        )
        return False
    if failed:
        exc = failed[0]
        if isinstance(exc, KafkaException | RuntimeError):
            raise ConsumerError(str(exc)) from exc
        raise exc
    return True


class AsyncKafkaConsumer:
    """:class:`KafkaConsumer` for asyncio callers.

    The calls that block (:meth:`consume`, :meth:`commit`, :meth:`close`) are coroutines that
    run on the consumer's own thread, one at a time, in the order they were made; the callbacks
    given here run on that thread too, inside :meth:`consume`. The calls that return at once
    (subscribing, pausing, resuming) and :meth:`commit_now`, which the rebalance callbacks make
    on the consumer's thread, are plain calls.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        on_error: Callable[[str, bool], None],
        on_commit: Callable[[str | None, list[Committed]], None],
    ) -> None:
        self._client = KafkaConsumer(config, on_error=on_error, on_commit=on_commit)
        self._thread = ClientThread("outbox-kafka-consumer")

    def subscribe(
        self,
        topics: Sequence[str],
        *,
        on_assign: Callable[[list[PartitionId]], None],
        on_revoke: Callable[[list[PartitionId]], None],
        on_lost: Callable[[list[PartitionId]], None],
    ) -> None:
        """See :meth:`KafkaConsumer.subscribe`."""
        self._client.subscribe(topics, on_assign=on_assign, on_revoke=on_revoke, on_lost=on_lost)

    async def consume(self, max_messages: int, timeout: float, wait: float = 0.0) -> list[Message]:
        """See :meth:`KafkaConsumer.consume`."""
        return await self._thread.run(self._client.consume, max_messages, timeout, wait)

    async def commit(
        self, offsets: Sequence[tuple[str, int, int]], *, sync: bool
    ) -> list[Committed]:
        """See :meth:`KafkaConsumer.commit`."""
        return await self._thread.run(self._client.commit, offsets, sync=sync)

    def commit_now(self, offsets: Sequence[tuple[str, int, int]]) -> list[Committed]:
        """See :meth:`KafkaConsumer.commit_now` (rebalance callbacks only: it blocks)."""
        return self._client.commit_now(offsets)

    def high_watermarks(self, partitions: Iterable[PartitionId]) -> dict[PartitionId, int]:
        """See :meth:`KafkaConsumer.high_watermarks` (local: returns at once)."""
        return self._client.high_watermarks(partitions)

    def pause(self, tp: PartitionId) -> None:
        """See :meth:`KafkaConsumer.pause`."""
        self._client.pause(tp)

    def resume(self, tp: PartitionId) -> None:
        """See :meth:`KafkaConsumer.resume`."""
        self._client.resume(tp)

    def release(self, partitions: Iterable[PartitionId]) -> None:
        """See :meth:`KafkaConsumer.release`."""
        self._client.release(partitions)

    async def check(self, timeout: float) -> bool:
        """See :meth:`KafkaConsumer.check`."""
        return await self._thread.run(self._client.check, timeout)

    async def close(self) -> None:
        """See :meth:`KafkaConsumer.close`; the consumer's thread ends afterwards."""
        try:
            await self._thread.run(self._client.close)
        finally:
            self._thread.close()
