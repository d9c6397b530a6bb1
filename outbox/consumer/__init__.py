"""The consumer runner: exactly-once effects from at-least-once delivery.

Invariant: a message's offset is committed only once its unit of work committed (or its guard's
claim stored the outcome), replayed a stored result, or the message was dead-lettered.
:class:`ConsumerRunner` runs plain handlers, :class:`AsyncConsumerRunner` coroutine handlers.
``consume_async`` is the asyncio form of :func:`consume`.

The names in ``__all__`` are the folder's face; every module beside this one is private.
"""

from __future__ import annotations

from outbox._core.retry import backoff_delay as _backoff_delay
from outbox._kafka.consumer import header_key as _header_key
from outbox._pg.errors import database_unavailable as _database_unavailable
from outbox.config import (
    ENV_CONSUMER_GROUP as _ENV_GROUP,
    ENV_CONSUMER_METRICS_PORT as _ENV_METRICS_PORT,
    ENV_KAFKA_CONFIG as _ENV_KAFKA_CONFIG,
)
from outbox.consumer._attempt import Attempts
from outbox.consumer._attempt_async import AsyncAttempts
from outbox.consumer._metrics import ConsumerMetrics
from outbox.consumer._runner import (
    AttemptVerdict,
    ConsumerConfig,
    ConsumerError,
    ConsumerRunner,
    DeadLetterInfo,
    FingerprintFunc,
    GuardedHandler,
    Handler,
    KeyFunc,
    MessageBatch,
    Reason,
    batch_handler,
    consume,
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
    # The API (docs/api.md).
    "AsyncConsumerRunner",
    "AsyncGuardedHandler",
    "AsyncHandler",
    "AsyncMessageBatch",
    "AttemptVerdict",
    "ConsumerConfig",
    "ConsumerError",
    "ConsumerRunner",
    "DeadLetterInfo",
    "FingerprintFunc",
    "GuardedHandler",
    "Handler",
    "KeyFunc",
    "MessageBatch",
    "Reason",
    "batch_handler",
    "consume",
    "consume_async",
    "message_fingerprint",
    "serve_metrics",
    "topic_fingerprint",
]
# What the package's integrations build on (outbox.django, outbox.testing): the attempts at a
# message and the runner's metrics. Not API.
__all__ += ["AsyncAttempts", "Attempts", "ConsumerMetrics"]

# Names this face offered in earlier releases: each still imports from here (Outcome is
# AttemptVerdict's earlier name; the others are not the consumer's API).
_EARLIER: dict[str, object] = {
    "ENV_GROUP": _ENV_GROUP,
    "ENV_KAFKA_CONFIG": _ENV_KAFKA_CONFIG,
    "ENV_METRICS_PORT": _ENV_METRICS_PORT,
    "Outcome": AttemptVerdict,
    "backoff_delay": _backoff_delay,
    "database_unavailable": _database_unavailable,
    "header_key": _header_key,
}


def __getattr__(name: str) -> object:
    if name in _EARLIER:
        return _EARLIER[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
