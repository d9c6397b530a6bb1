"""``Idempotency-Key`` middleware for Django views (and Django REST framework views).

``MIDDLEWARE = [..., "outbox.django.middleware.IdempotencyKeyMiddleware"]``, options in
``settings.OUTBOX["HTTP"]`` (the keyword arguments of :class:`outbox.http.wsgi.
IdempotencyMiddleware`: ``scope``, ``require_key``, ``methods``, ``max_request_bytes``, ...).

Invariant: the same decisions as the ASGI and WSGI middlewares, taken from the same core
(:mod:`outbox._core.http`): a covered request runs its view in :func:`outbox.django.unit_of_work`
on Django's connection, its response is stored with the key in the transaction Django commits,
and a duplicate gets the stored response with ``Idempotent-Replayed: true``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.http import HttpRequest, HttpResponse

from outbox._core.http import (
    Headers,
    Request,
    decode_response,
    encode_response,
    fingerprint,
    is_stored,
    quoted_path,
    replay_headers,
)
from outbox._core.http_admission import (
    HttpConfig,
)
from outbox._core.http_answers import (
    Refused,
    Response,
    problem_for,
    request_too_large,
    response_too_large,
    streaming_refused,
)
from outbox._core.http_context import Abort, bound
from outbox.django._settings import outbox_settings
from outbox.django._unit import unit_of_work
from outbox.errors import ConfigurationError, KeyInProgress, KeyReuseError, PreviouslyFailed


def _settings() -> HttpConfig:
    options = outbox_settings().get("HTTP", {})
    if not isinstance(options, dict):
        raise ConfigurationError('settings.OUTBOX["HTTP"] must be a dict of middleware options')
    try:
        return HttpConfig(**options)
    except TypeError as exc:
        raise ConfigurationError(f'settings.OUTBOX["HTTP"]: {exc}') from None


def _django(response: Response) -> HttpResponse:
    answer = HttpResponse(response.body, status=response.status)
    for name, value in response.headers:
        if name.lower() != "content-length":
            answer.headers[name] = value
    return answer


class IdempotencyKeyMiddleware:
    """Runs covered requests' views in a unit of work on Django's connection and replays
    their responses; see :mod:`outbox.django.middleware`."""

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.settings = _settings().admission()

    def __call__(self, request: HttpRequest) -> Any:
        settings = self.settings
        method = (request.method or "").upper()
        if method not in settings.methods:
            return self.get_response(request)
        meta = request.META
        headers = Headers((name.lower(), value) for name, value in request.headers.items())
        uri = meta.get("RAW_URI") or meta.get("REQUEST_URI")
        if isinstance(uri, str) and uri:
            raw_path, _, query = uri.partition("?")
        else:
            raw_path = quoted_path(request.path.encode("utf-8", "surrogateescape"))
            query = meta.get("QUERY_STRING", "")
        covered_request = Request(method, request.path, headers, query, raw_path)
        try:
            covered = settings.admit(covered_request)
            if covered is not None:
                settings.check_declared_length(meta.get("CONTENT_LENGTH") or None)
                body = request.body
                if len(body) > settings.max_request_bytes:
                    raise Refused(request_too_large(settings.max_request_bytes))
        except Refused as refused:
            return _django(refused.problem.response())
        if covered is None:
            return self.get_response(request)
        caller = settings.caller_of(covered_request)
        request_fingerprint = fingerprint(method, covered_request.target, body, caller)
        failure: BaseException | None = None
        answer: Any = None
        try:
            with unit_of_work(covered.key, covered.scope, request_fingerprint) as uow:
                if uow.replayed:
                    stored = decode_response(uow.result)
                    return _django(Response(stored.status, replay_headers(stored), stored.body))
                with bound(uow):
                    try:
                        answer = self.get_response(request)
                    except BaseException as exc:
                        raise Abort(error=exc) from None
                self._store(uow, answer)
        except Abort as abort:
            if abort.error is not None:
                failure = abort.error
            else:
                assert abort.response is not None
                return answer if abort.response is _PASS else _django(abort.response)
        except (KeyInProgress, KeyReuseError, PreviouslyFailed) as exc:
            problem = problem_for(exc, settings.retry_after)
            assert problem is not None
            return _django(problem.response())
        if failure is not None:
            raise failure
        return answer

    def _store(self, uow: Any, answer: Any) -> None:
        """Store ``answer`` with the key, or raise :class:`Abort` to roll the unit back."""
        limit = self.settings.max_response_bytes
        if getattr(answer, "streaming", False):
            raise Abort(response=streaming_refused().response())
        if hasattr(answer, "render") and not getattr(answer, "is_rendered", True):
            answer.render()  # a TemplateResponse (Django REST framework's Response too)
        status = int(answer.status_code)
        if not is_stored(status):
            raise Abort(response=_PASS)
        content = bytes(answer.content)
        if len(content) > limit:
            raise Abort(response=response_too_large(limit).response())
        uow.result = encode_response(
            status, list(answer.items()), content, self.settings.stored_headers
        )


# The view's own response, sent as it is but not stored (a 5xx, a transient 4xx).
_PASS = Response(0, [], b"")
