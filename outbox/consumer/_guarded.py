# generated from outbox/consumer/_guarded_async.py by tools/async_to_sync.py; do not edit
"""Generated from ``outbox/consumer/_guarded_async.py`` by ``tools/async_to_sync.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from outbox._core.disposition import Outcome
from outbox._core.offsets import Tries
from outbox._kafka.consumer import Message
from outbox.consumer._attempt import Verdicts

if TYPE_CHECKING:
    from outbox.config import ConsumerConfig
    from outbox.consumer._metrics import ConsumerMetrics
    from outbox.guard._guard import RedisGuard


class GuardedAttempts(Verdicts):
    """Attempts at messages, each under a claim of the runner's
    :class:`~outbox.guard.RedisGuard`. ``rules`` are :class:`Verdicts`'
    keywords (``key_func``, ``fingerprint_func``, ``beat``)."""

    def __init__(
        self,
        guard: RedisGuard,
        handler: Callable[..., Any],
        config: ConsumerConfig,
        metrics: ConsumerMetrics,
        **rules: Any,
    ) -> None:
        permanent = guard.settings.permanent_errors
        super().__init__(handler, config, metrics, permanent_errors=permanent, **rules)
        self.guard = guard

    def alone(self, message: Message, tries: Tries, key: str, fingerprint: str | None) -> Outcome:
        return self.attempt(
            message,
            tries,
            key,
            lambda: self.guard.claim(key, scope=self._scope, fingerprint=fingerprint),
        )
