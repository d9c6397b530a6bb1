"""Dead letters: where the consumer runner puts a message it will not apply, and why.

A dead letter is the original record (key, value and headers unchanged) produced to
``<topic><suffix>`` (``orders.dlq`` by default) with extra ``outbox.dlq.*`` headers naming the
reason, the error, the number of attempts and the original topic, partition and offset. It is
produced with an idempotent producer (``acks=all``) and the runner waits for the broker's
confirmation before it commits the original offset, so a message is never dropped on the floor
(the producer is :class:`outbox._kafka.deadletter.DeadLetterProducer`).

The runner avoids writing a second dead letter for the same message where it can (see
``docs/consumer.md``); when a crash lands between the confirmation and the offset commit the
message is dead-lettered again on redelivery. Readers of the dead-letter topic can drop such
copies by ``(outbox.dlq.topic, outbox.dlq.partition, outbox.dlq.offset)``, or by the
``X-Idempotency-Key`` header the original carried.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from outbox._core.codec import IDEMPOTENCY_HEADER
from outbox._core.redact import one_line, redact_text

HEADER_PREFIX = "outbox.dlq."
HEADER_REASON = "outbox.dlq.reason"
HEADER_ERROR = "outbox.dlq.error"
HEADER_ERROR_TYPE = "outbox.dlq.error-type"
HEADER_ATTEMPTS = "outbox.dlq.attempts"
HEADER_TOPIC = "outbox.dlq.topic"
HEADER_PARTITION = "outbox.dlq.partition"
HEADER_OFFSET = "outbox.dlq.offset"
HEADER_GROUP = "outbox.dlq.group"

MAX_ERROR_TEXT = 1000  # the error header: enough to diagnose, small next to the record


class Reason(StrEnum):
    """Why a message was dead-lettered (the ``outbox.dlq.reason`` header)."""

    MISSING_KEY = "missing-key"
    """The message carried no idempotency key, so it cannot be applied at most once."""
    INVALID_INPUT = "invalid-input"
    """The key, the handler's result or an event it published was refused (ValidationError)."""
    KEY_REUSE = "key-reuse"
    """The key was used before for a different request (fingerprint mismatch)."""
    PERMANENT_ERROR = "permanent-error"
    """The handler raised a permanent error; the key is recorded as failed."""
    RETRIES_EXHAUSTED = "retries-exhausted"
    """The handler kept failing for ``max_attempts`` attempts; the key stays free for a redrive."""


@dataclass(frozen=True)
class DeadLetter:
    """What the runner knows about a failed message, written into the dead letter's headers."""

    reason: Reason
    error: str
    error_type: str
    attempts: int

    @classmethod
    def from_exception(cls, reason: Reason, exc: BaseException, attempts: int) -> DeadLetter:
        """Describe ``exc`` as a dead letter: its type name and the first line of its message,
        secrets and control characters hidden (:func:`outbox._core.redact.one_line`), truncated.

        The message may quote the consumed record (a value the handler could not parse): one
        line, so that it cannot forge a log line or a header reader's record."""
        try:
            str(exc)
        except Exception:  # a __str__ that fails must not stop the dead letter
            error = f"{type(exc).__name__}: (the exception's message could not be read)"
        else:
            error = redact_text(one_line(exc))[:MAX_ERROR_TEXT]
        return cls(reason, error, type(exc).__name__, attempts)


@dataclass(frozen=True)
class DeadLetterInfo:
    """The ``outbox.dlq.*`` headers of a record read from a dead-letter topic, parsed."""

    reason: str
    error: str
    error_type: str
    attempts: int
    topic: str
    partition: int
    offset: int
    group: str
    idempotency_key: str | None

    @classmethod
    def from_headers(cls, headers: Sequence[tuple[str, bytes | None]] | None) -> DeadLetterInfo:
        """Parse a dead letter's headers; raises ``KeyError`` if one of ours is missing."""
        found: dict[str, str] = {}
        for name, value in headers or ():
            if value is not None and (name.startswith(HEADER_PREFIX) or name == IDEMPOTENCY_HEADER):
                found.setdefault(name, value.decode("utf-8", errors="replace"))
        return cls(
            reason=found[HEADER_REASON],
            error=found[HEADER_ERROR],
            error_type=found[HEADER_ERROR_TYPE],
            attempts=int(found[HEADER_ATTEMPTS]),
            topic=found[HEADER_TOPIC],
            partition=int(found[HEADER_PARTITION]),
            offset=int(found[HEADER_OFFSET]),
            group=found[HEADER_GROUP],
            idempotency_key=found.get(IDEMPOTENCY_HEADER),
        )


def dead_letter_topic(topic: str, suffix: str) -> str:
    """The dead-letter topic of ``topic``: ``topic + suffix``."""
    return topic + suffix


def dead_letter_headers(
    original: Sequence[tuple[str, bytes | None]] | None,
    *,
    topic: str,
    partition: int,
    offset: int,
    group: str,
    letter: DeadLetter,
) -> list[tuple[str, bytes]]:
    """The original headers (minus stale ``outbox.dlq.*`` ones) followed by ours.

    Stale headers are dropped so a redriven message that fails again describes its latest
    failure only.
    """
    headers = [
        (name, value if value is not None else b"")
        for name, value in (original or ())
        if not name.startswith(HEADER_PREFIX)
    ]
    headers.extend(
        [
            (HEADER_REASON, str(letter.reason).encode()),
            (HEADER_ERROR, letter.error.encode("utf-8", errors="replace")),
            (HEADER_ERROR_TYPE, letter.error_type.encode("utf-8", errors="replace")),
            (HEADER_ATTEMPTS, str(letter.attempts).encode()),
            (HEADER_TOPIC, topic.encode("utf-8")),
            (HEADER_PARTITION, str(partition).encode()),
            (HEADER_OFFSET, str(offset).encode()),
            (HEADER_GROUP, group.encode("utf-8")),
        ]
    )
    return headers
