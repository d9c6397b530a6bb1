"""The HTTP door: ``Idempotency-Key`` middlewares for ASGI and WSGI applications (docs/http.md).

Invariant: a handler's rows, its events and its response commit in one transaction before the
response is sent; a duplicate gets the stored response back, byte for byte, with
``Idempotent-Replayed: true``, and the handler does not run again.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

from outbox._core.http import (
    DEFAULT_CALLER_HEADERS,
    DEFAULT_STORED_HEADERS,
    Headers,
    Request,
)
from outbox._core.http_answers import (
    Response,
)
from outbox.errors import NoUnitOfWork

if TYPE_CHECKING:
    from collections.abc import Iterator

    from outbox.uow import AsyncUnitOfWork, UnitOfWork

__all__ = [
    "DEFAULT_CALLER_HEADERS",
    "DEFAULT_STORED_HEADERS",
    "Headers",
    "Request",
    "current_unit_of_work",
]

# A context variable reaches the handler on the request's own task, on the tasks and threads
# that copy its context (Starlette's thread pool for sync endpoints), and on a WSGI server's
# request thread -- never another request.
_current: ContextVar[AsyncUnitOfWork | UnitOfWork | None] = ContextVar(
    "outbox_http_unit_of_work", default=None
)


def current_unit_of_work() -> AsyncUnitOfWork | UnitOfWork:
    """The unit of work of the request being handled (an :class:`~outbox.AsyncUnitOfWork` under
    the ASGI middleware, a :class:`~outbox.UnitOfWork` under the WSGI one).

    Raises :class:`~outbox.errors.NoUnitOfWork` outside a covered request: a method the
    middleware does not cover, a request without an ``Idempotency-Key`` where none is
    required, or code that does not run on the request's task or thread.
    """
    uow = _current.get()
    if uow is None:
        raise NoUnitOfWork(
            "no unit of work: current_unit_of_work() works inside a request that "
            "IdempotencyMiddleware covers (a method in its `methods`, with an Idempotency-Key "
            "header), on the request's own task or thread"
        )
    return uow


@contextmanager
def _bound(uow: AsyncUnitOfWork | UnitOfWork) -> Iterator[None]:
    token = _current.set(uow)
    try:
        yield
    finally:
        _current.reset(token)


class _Abort(BaseException):
    """Raised inside the unit of work to roll it back when nothing may be stored: the handler
    raised (``error``), or its response is not stored (``response``: a 5xx, a transient 4xx, a
    refused stream). A ``BaseException``, so that no ``permanent_errors`` setting turns it into
    a recorded failure: the key stays free for the client's retry."""

    def __init__(
        self, *, error: BaseException | None = None, response: Response | None = None
    ) -> None:
        super().__init__()
        self.error = error
        self.response = response
