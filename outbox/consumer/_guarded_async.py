"""One attempt at a consumed message under the Redis guard (:mod:`outbox.guard`).

For handlers whose effects are not in PostgreSQL, the runner can hold each message's key with an
:class:`~outbox.guard.AsyncRedisGuard` instead of a unit of work: the handler runs as
``handler(claim, message)`` inside ``guard.claim(key, scope=<the runner's scope>,
fingerprint=...)``, and its return value is stored as the claim's result. Everything else -- the
key rules, the verdict of :func:`outbox._core.disposition.classify`, retries and dead letters --
is the unit of work's (:class:`outbox.consumer._attempt_async.AsyncVerdicts`):

* the claim is entered: ``replayed`` -- the handler is not called, the message is finished;
* the handler returns: the guard stores the result (COMPLETED) when the claim ends, and only
  then is the message finished (its offset may be committed);
* a permanent error (``PermanentError`` or one of the guard's ``permanent_errors``): the
  message is dead-lettered while the claim holds the key, then the guard records FAILED, so
  later duplicates are acknowledged (``PreviouslyFailed``) without a second dead letter;
* any other error: the guard releases the key and the message is retried with backoff,
  dead-lettered once its attempts run out;
* ``KeyInProgress`` (another owner's lease) and ``LeaseLost`` (this owner's lease ran out and
  another owner took over): retried after the in-progress backoff, never a wait, never counted;
* ``GuardUnavailable`` (Redis cannot decide, or did not store the outcome, under
  ``on_redis_error="closed"``): retried, not counted -- like a database outage. Under
  ``"open"`` the guard runs the handler unguarded and the message counts as processed.

There is no transaction to share, so a guarded runner handles one message at a time
(``batch_size=1``) and takes no batch handler. Written for asyncio;
``outbox/consumer/_guarded.py`` is generated from it by ``tools/async_to_sync.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from outbox._core.disposition import Outcome
from outbox._core.offsets import Tries
from outbox._kafka.consumer import Message
from outbox.consumer._attempt_async import AsyncVerdicts

if TYPE_CHECKING:
    from outbox.config import ConsumerConfig
    from outbox.consumer._metrics import ConsumerMetrics
    from outbox.guard._guard_async import AsyncRedisGuard


class AsyncGuardedAttempts(AsyncVerdicts):
    """Attempts at messages, each under a claim of the runner's
    :class:`~outbox.guard.AsyncRedisGuard`. ``rules`` are :class:`AsyncVerdicts`'
    keywords (``key_func``, ``fingerprint_func``, ``beat``)."""

    def __init__(
        self,
        guard: AsyncRedisGuard,
        handler: Callable[..., Any],
        config: ConsumerConfig,
        metrics: ConsumerMetrics,
        **rules: Any,
    ) -> None:
        permanent = guard.settings.permanent_errors
        super().__init__(handler, config, metrics, permanent_errors=permanent, **rules)
        self.guard = guard

    async def alone(
        self, message: Message, tries: Tries, key: str, fingerprint: str | None
    ) -> Outcome:
        return await self.attempt(
            message,
            tries,
            key,
            lambda: self.guard.claim(key, scope=self._scope, fingerprint=fingerprint),
        )
