"""The answers the HTTP door gives: a :class:`Response`, and the refusals, each an
``application/problem+json`` answer (RFC 9457, :class:`Problem`) -- one per reason a request is
not run, and what an outbox error means to an HTTP client.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Final

from outbox.errors import (
    KeyInProgress,
    KeyReuseError,
    OutboxError,
    PreviouslyFailed,
)

PROBLEM_CONTENT_TYPE: Final = "application/problem+json"
PROBLEM_TYPE_BASE: Final = "tag:outbox-kit,2026:http/"

# -- problems (RFC 9457) --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Response:
    """A complete HTTP response: status, header pairs (``str``, ISO-8859-1) and body."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes


@dataclass(frozen=True, slots=True)
class Problem:
    """An ``application/problem+json`` answer: ``type`` is :data:`PROBLEM_TYPE_BASE` + ``slug``."""

    status: int
    slug: str
    title: str
    detail: str
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def type(self) -> str:
        return PROBLEM_TYPE_BASE + self.slug

    def body(self) -> bytes:
        document = {
            "type": self.type,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }
        return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    def response(self) -> Response:
        body = self.body()
        headers = [
            ("content-type", PROBLEM_CONTENT_TYPE),
            ("content-length", str(len(body))),
            *self.headers,
        ]
        return Response(self.status, headers, body)


class Refused(Exception):
    """A request the middleware answers itself with :attr:`problem`, before or instead of the
    handler."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(f"{problem.status} {problem.title}: {problem.detail}")
        self.problem = problem


def invalid_key(detail: str) -> Refused:
    return Refused(Problem(400, "idempotency-key-invalid", "Invalid Idempotency-Key", detail))


def missing_key() -> Problem:
    return Problem(
        400,
        "idempotency-key-missing",
        "Idempotency-Key missing",
        "this endpoint requires an Idempotency-Key header (a unique value per operation, "
        "e.g. a UUID); send the same key again to retry the operation safely",
    )


def request_too_large(limit: int) -> Problem:
    return Problem(
        413,
        "request-too-large",
        "Request body too large",
        f"requests with an Idempotency-Key may carry at most {limit} bytes of body",
    )


def response_too_large(limit: int) -> Problem:
    return Problem(
        500,
        "response-too-large",
        "Response too large to store",
        f"the response is larger than {limit} bytes, the most an idempotent response may "
        "hold; nothing was stored, so the operation may be retried with the same key",
    )


def streaming_refused() -> Problem:
    return Problem(
        500,
        "streaming-response",
        "Streaming response refused",
        "a streaming response cannot be stored for replay; endpoints covered by the "
        "Idempotency-Key middleware must return a complete response (with a known length). "
        "Nothing was stored, so the operation may be retried with the same key",
    )


def problem_for(exc: OutboxError, retry_after: int) -> Problem | None:
    """The answer to a unit of work's refusal, or ``None`` for an error that is not one."""
    if isinstance(exc, KeyInProgress):
        return Problem(
            409,
            "idempotency-key-in-progress",
            "Request in progress",
            "a request with this Idempotency-Key is being processed right now; retry after "
            f"{retry_after} s to get its response",
            (("retry-after", str(retry_after)),),
        )
    if isinstance(exc, KeyReuseError):
        return Problem(
            422,
            "idempotency-key-reused",
            "Idempotency-Key reused",
            "this Idempotency-Key was used for a different request (method, path, body or "
            "caller's credentials); use a new key for a new request",
        )
    if isinstance(exc, PreviouslyFailed):
        return Problem(
            422,
            "idempotency-key-failed",
            "Idempotency-Key failed",
            "the operation of this Idempotency-Key failed permanently; use a new key",
        )
    return None
