"""What both flavours of the consumer runner (:mod:`outbox.consumer._runner_async` and its sync
twin) share: stopping, health and readiness, the client's callbacks that wait for nothing,
and what a guarded runner refuses. Nothing here waits, so it is written once, not generated."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from outbox._core.handlers import BATCH_HANDLER
from outbox._core.offsets import Assignment, PartitionId
from outbox._kafka.consumer import Committed, Message, coordinates
from outbox.config import ConsumerConfig
from outbox.consumer._metrics import ConsumerMetrics
from outbox.errors import ConfigurationError

log = logging.getLogger("outbox.consumer")


class RunnerBase:
    """The state a runner's loop and its client's callbacks share, and what they decide
    without waiting; each flavour's runner sets it up in its ``__init__``."""

    config: ConsumerConfig
    _metrics: ConsumerMetrics
    _stopping: threading.Event
    _partitions: Assignment[Message]
    _fatal: str | None
    _heartbeat: float | None
    _broker_up: bool
    _database_up: bool

    def stop(self) -> None:
        """Ask :meth:`run` to return after the message in hand (safe from signal handlers)."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called."""
        return self._stopping.is_set()

    def healthy(self, max_silence: float) -> bool:
        """True while :meth:`run` is consuming and its loop moved within ``max_silence`` seconds.

        The loop moves on every poll (at least every ``poll_timeout``) and on every attempt at a
        message, so only one step that takes longer -- a handler, or a dead letter waiting up to
        ``dlq_timeout`` for the broker -- makes the runner look stuck. False before :meth:`run`,
        once :meth:`stop` was called, and after :meth:`run` returned.
        """
        beat = self._heartbeat
        return (
            beat is not None
            and not self._stopping.is_set()
            and time.monotonic() - beat <= max_silence
        )

    def ready(self, max_silence: float) -> bool:
        """True while :meth:`healthy` holds and the last checks (every
        ``READY_CHECK_INTERVAL`` seconds) reached the broker and, for a runner with an outbox,
        PostgreSQL: what ``/readyz`` answers."""
        return self._broker_up and self._database_up and self.healthy(max_silence)

    def _beat(self) -> None:
        self._heartbeat = time.monotonic()

    def _on_client_error(self, error: str, fatal: bool) -> None:
        # librdkafka reconnects by itself; these are reported, never dropped silently.
        if fatal:
            log.error("fatal Kafka client error: %s", error)
            self._fatal = error
            self.stop()
        else:
            log.warning("Kafka client error: %s", error)

    def _on_assign(self, partitions: list[PartitionId]) -> None:
        self._partitions.assign(partitions)
        log.info("assigned %s", _describe(partitions))

    def _on_commit(self, error: str | None, committed: list[Committed]) -> None:
        if error is not None:
            # The next commit carries the same or a later offset; until then a crash only means
            # redelivery, which the idempotency key absorbs.
            log.warning("offset commit failed: %s", error)
            return
        for topic, partition, offset, failed in committed:
            if failed is not None:
                log.warning("offset commit of %s[%d] failed: %s", topic, partition, failed)
                continue
            self._partitions.confirm((topic, partition), offset)

    def _poll_timeout(self) -> float:
        longest = min(self.config.poll_timeout, self.config.commit_interval)
        return self._partitions.next_retry(time.monotonic(), longest)

    def _accept(self, message: Message) -> None:
        topic, partition, offset = coordinates(message)
        state = self._partitions.get((topic, partition))
        if state is None:
            # Fetched before its partition was revoked in this same poll: it belongs to the new
            # owner now. Processing it here would apply it with no offset of ours to commit,
            # and the new owner would meet it again.
            log.debug("dropped %s[%d]@%d: partition no longer assigned", topic, partition, offset)
            return
        state.backlog.append(message)
        self._metrics.received(self.config.group, topic)


def _check_guarded(config: ConsumerConfig, handler: object) -> None:
    """Refuse what a runner under the Redis guard cannot do: there is no transaction for
    messages to share, so no micro-batches and no batch handler."""
    if config.batch_size != 1 and config.concurrency == 1:
        raise ConfigurationError(
            f"a runner with a Redis guard handles one message at a time: batch_size must be 1, "
            f"got {config.batch_size} (micro-batches share a PostgreSQL transaction, which a "
            "guard does not have; with concurrency above 1, batch_size is how many messages a "
            "turn takes, each under a claim of its own)"
        )
    if getattr(handler, BATCH_HANDLER, False):
        raise ConfigurationError(
            "a runner with a Redis guard takes handler(claim, message), not a @batch_handler: "
            "batches need an outbox"
        )


def _describe(partitions: Iterable[tuple[Any, ...]]) -> str:
    parts = [f"{p[0]}[{p[1]}]" for p in partitions]
    return ", ".join(parts) if parts else "nothing"
