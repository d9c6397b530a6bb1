"""What the HTTP middlewares (ASGI, WSGI and Django's) share while a request runs: the request's
unit of work, bound for the code the handler calls, and the abort that rolls it back.

Invariant: a unit of work is bound only for the request's own task or thread (and what copies
its context), never for another request.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

    from outbox._core.http_answers import Response

# A context variable reaches the handler on the request's own task, on the tasks and threads
# that copy its context (Starlette's thread pool for sync endpoints), and on a WSGI server's
# request thread -- never another request. Typed ``object`` here: the layer above knows the
# unit of work's class (outbox.http.current_unit_of_work).
_current: ContextVar[object | None] = ContextVar("outbox_http_unit_of_work", default=None)


def current() -> object | None:
    """The unit of work bound for the request being handled, or None."""
    return _current.get()


@contextmanager
def bound(uow: object) -> Iterator[None]:
    """Bind ``uow`` as the request's unit of work while the handler runs."""
    token = _current.set(uow)
    try:
        yield
    finally:
        _current.reset(token)


class Abort(BaseException):
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
