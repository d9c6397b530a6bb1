"""What a failure means, decided once for the unit of work, the consumer runner and the guard.

The unit of work records a key as failed when its body raised a *permanent* error; the consumer
runner dead-letters a message whose handler raised one, while the key is still held and before
the failure is recorded. A key recorded as failed must always have been dead-lettered, so both
ask the same question here.

The toolkit's own exceptions are never the key's failure, whatever ``permanent_errors`` lists:
an :class:`~outbox.errors.InvalidTopicError` from ``uow.publish()``, a
:class:`~outbox.errors.ConfigurationError`, a :class:`~outbox.errors.KeyInProgress` of another
key... are refusals of a call the body made (a programming error, or a moment), not the
business verdict on the request. Recording one would answer every retry -- after the handler is
fixed -- with :class:`~outbox.errors.PreviouslyFailed`. ``ValidationError`` and
``ConfigurationError`` are ``ValueError`` subclasses, so ``permanent_errors=(ValueError,)``
would otherwise catch them. Only :class:`~outbox.errors.PermanentError` (and its subclasses)
records a failure among them: that is the body saying so.
"""

from __future__ import annotations

from outbox.errors import OutboxError, PermanentError


def is_refusal(exc: BaseException) -> bool:
    """True when ``exc`` is raised by the toolkit itself (an :class:`~outbox.errors.OutboxError`
    other than :class:`~outbox.errors.PermanentError`): never recorded as a key's failure."""
    return isinstance(exc, OutboxError) and not isinstance(exc, PermanentError)


def is_permanent(exc: BaseException, extra: tuple[type[BaseException], ...] = ()) -> bool:
    """True when ``exc`` is a :class:`~outbox.errors.PermanentError` or an instance of one of
    ``extra`` (``OutboxConfig.permanent_errors``): trying again cannot succeed. The toolkit's
    own refusals (:func:`is_refusal`) are never permanent, whatever ``extra`` holds."""
    if isinstance(exc, PermanentError):
        return True
    return bool(extra) and isinstance(exc, extra) and not is_refusal(exc)
