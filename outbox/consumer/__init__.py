"""The consumer runner: exactly-once effects from at-least-once delivery.

Invariant: a message's offset is committed only once its unit of work committed (or its guard's
claim stored the outcome), replayed a stored result, or the message was dead-lettered.
:class:`ConsumerRunner` runs plain handlers, :class:`AsyncConsumerRunner` coroutine handlers.
``consume_async`` is the asyncio form of :func:`consume`.
"""

from __future__ import annotations

from outbox.consumer._runner import (
    ENV_GROUP,
    ENV_KAFKA_CONFIG,
    ENV_METRICS_PORT,
    ConsumerConfig,
    ConsumerError,
    ConsumerRunner,
    DeadLetterInfo,
    FingerprintFunc,
    GuardedHandler,
    Handler,
    KeyFunc,
    MessageBatch,
    Outcome,
    Reason,
    backoff_delay,
    batch_handler,
    consume,
    database_unavailable,
    header_key,
    message_fingerprint,
    serve_metrics,
    topic_fingerprint,
)
from outbox.consumer._runner_async import (
    AsyncConsumerRunner,
    AsyncGuardedHandler,
    AsyncHandler,
    AsyncMessageBatch,
    consume as consume_async,
)

__all__ = [
    "ENV_GROUP",
    "ENV_KAFKA_CONFIG",
    "ENV_METRICS_PORT",
    "AsyncConsumerRunner",
    "AsyncGuardedHandler",
    "AsyncHandler",
    "AsyncMessageBatch",
    "ConsumerConfig",
    "ConsumerError",
    "ConsumerRunner",
    "DeadLetterInfo",
    "FingerprintFunc",
    "GuardedHandler",
    "Handler",
    "KeyFunc",
    "MessageBatch",
    "Outcome",
    "Reason",
    "backoff_delay",
    "batch_handler",
    "consume",
    "consume_async",
    "database_unavailable",
    "header_key",
    "message_fingerprint",
    "serve_metrics",
    "topic_fingerprint",
]
