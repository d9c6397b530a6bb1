"""The HTTP door: ``Idempotency-Key`` middlewares for ASGI and WSGI applications (docs/http.md).

Invariant: a handler's rows, its events and its response commit in one transaction before the
response is sent; a duplicate gets the stored response back, byte for byte, with
``Idempotent-Replayed: true``, and the handler does not run again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from outbox._core.http import (
    DEFAULT_CALLER_HEADERS,
    DEFAULT_STORED_HEADERS,
    Headers,
    Request,
)
from outbox._core.http_context import current
from outbox.errors import NoUnitOfWork

if TYPE_CHECKING:
    from outbox.uow import AsyncUnitOfWork, UnitOfWork

__all__ = [
    "DEFAULT_CALLER_HEADERS",
    "DEFAULT_STORED_HEADERS",
    "Headers",
    "Request",
    "current_unit_of_work",
]


def current_unit_of_work() -> AsyncUnitOfWork | UnitOfWork:
    """The unit of work of the request being handled (an :class:`~outbox.AsyncUnitOfWork` under
    the ASGI middleware, a :class:`~outbox.UnitOfWork` under the WSGI one).

    Raises :class:`~outbox.errors.NoUnitOfWork` outside a covered request: a method the
    middleware does not cover, a request without an ``Idempotency-Key`` where none is
    required, or code that does not run on the request's task or thread.
    """
    uow = current()
    if uow is None:
        raise NoUnitOfWork(
            "no unit of work: current_unit_of_work() works inside a request that "
            "IdempotencyMiddleware covers (a method in its `methods`, with an Idempotency-Key "
            "header), on the request's own task or thread"
        )
    return cast("AsyncUnitOfWork | UnitOfWork", uow)
