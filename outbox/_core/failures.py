"""What a failure means, decided once for the unit of work and the consumer runner.

The unit of work records a key as failed when its body raised a *permanent* error; the consumer
runner dead-letters a message whose handler raised one, while the key is still held and before
the failure is recorded. A key recorded as failed must always have been dead-lettered, so both
ask the same question here.
"""

from __future__ import annotations

from outbox.errors import PermanentError


def is_permanent(exc: BaseException, extra: tuple[type[BaseException], ...] = ()) -> bool:
    """True when ``exc`` is a :class:`~outbox.errors.PermanentError` or an instance of one of
    ``extra`` (``OutboxConfig.permanent_errors``): trying again cannot succeed."""
    return isinstance(exc, PermanentError) or (bool(extra) and isinstance(exc, extra))
