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


# Answers of an HTTP service that may change on their own (a timeout, throttling, an outage).
_TRANSIENT_STATUS = frozenset({408, 425, 429})
# Libraries whose exceptions are transport failures (a schema registry client's HTTP stack).
_TRANSPORT_MODULES = frozenset({"httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3"})


def is_unreachable(exc: BaseException) -> bool:
    """True when ``exc`` says a remote service (a schema registry) could not answer: a network
    or timeout error, or an HTTP answer of 5xx, 408, 425 or 429 (an ``http_status_code``
    attribute, as confluent-kafka's ``SchemaRegistryError`` has). Trying again may succeed;
    any other answer (404: unknown subject or schema, 422: incompatible) will not change."""
    status = getattr(exc, "http_status_code", None)
    if isinstance(status, int) and status > 0:
        return status >= 500 or status in _TRANSIENT_STATUS
    if isinstance(exc, OSError | TimeoutError):
        return True
    return any(cls.__module__.partition(".")[0] in _TRANSPORT_MODULES for cls in type(exc).__mro__)
