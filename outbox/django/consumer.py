"""The consumer runner on Django's connection: each message's handler runs inside
:func:`outbox.django.unit_of_work`, writing with the Django ORM.

``handler(uow, message)`` as for :class:`outbox.consumer.ConsumerRunner`, whose verdicts,
retries, dead letters, offsets and metrics are the ones used here. One message at a time
(``batch_size=1``): a micro-batch shares one SQLAlchemy transaction, which Django's connection
is not.
"""

from __future__ import annotations

from typing import Any

from outbox._core.disposition import AttemptVerdict
from outbox._core.offsets import Tries
from outbox.consumer import Attempts, ConsumerConfig, ConsumerRunner
from outbox.django._settings import alias_of, outbox_for
from outbox.django._unit import unit_of_work
from outbox.errors import ConfigurationError


class _DjangoAttempts(Attempts):
    """Attempts at messages in Django units of work (always alone, see the module)."""

    def __init__(self, *args: Any, using: str, **rules: Any) -> None:
        super().__init__(*args, **rules)
        self._using = using

    def alone(
        self, message: Any, tries: Tries, key: str, fingerprint: str | None
    ) -> AttemptVerdict:
        return self.attempt(
            message,
            tries,
            key,
            lambda: unit_of_work(key, self._scope, fingerprint, using=self._using),
        )


class DjangoConsumerRunner(ConsumerRunner):
    """:class:`~outbox.consumer.ConsumerRunner` whose units of work run on Django's connection
    of the ``DATABASES`` alias ``using`` (default: ``settings.OUTBOX["DATABASE"]``)."""

    def __init__(
        self,
        handler: Any,
        config: ConsumerConfig | None = None,
        *,
        using: str | None = None,
        **settings: Any,
    ) -> None:
        self._alias = alias_of(using)
        if config is None:
            settings.setdefault("batch_size", 1)
        super().__init__(outbox_for(self._alias), handler, config, **settings)
        if self.config.batch_size != 1:
            raise ConfigurationError(
                "the Django consumer runner handles one message at a time: batch_size must be "
                f"1, got {self.config.batch_size} (a micro-batch shares one SQLAlchemy "
                "transaction, which Django's connection is not)"
            )

    def _attempts(self, dlq: Any) -> Any:
        assert self.outbox is not None
        return _DjangoAttempts(
            self.outbox, self._handler, self.config, self._metrics,
            dlq=dlq, using=self._alias, **self._rules,
        )  # fmt: skip
