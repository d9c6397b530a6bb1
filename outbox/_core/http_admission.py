"""The HTTP door's settings and the admission of a request: whether a method is covered, its
key, its scope, its caller and its size, decided before the unit of work begins.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from outbox._core.http import (
    DEFAULT_CALLER_HEADERS,
    DEFAULT_HTTP_SCOPE,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_METHODS,
    DEFAULT_RETRY_AFTER,
    DEFAULT_STORED_HEADERS,
    IDEMPOTENCY_KEY_HEADER,
    MissingHeader,
    Request,
    parse_key,
)
from outbox._core.http_answers import Problem, Refused, missing_key, request_too_large
from outbox._core.validate import check_scope, shown
from outbox.errors import (
    ConfigurationError,
    InvalidKeyError,
)

# -- settings and admission -----------------------------------------------------------------

ScopeOf = Callable[[Request], str]
PrincipalOf = Callable[[Request], "str | None"]


@dataclass(frozen=True, slots=True)
class Covered:
    """A request that runs in a unit of work of ``(scope, key)``."""

    scope: str
    key: str


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """The middlewares' options (see :mod:`outbox.http`), checked once by :meth:`admission`."""

    scope: str | ScopeOf | None = None
    require_key: bool = False
    methods: Iterable[str] = DEFAULT_METHODS
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    stored_headers: Iterable[str] = DEFAULT_STORED_HEADERS
    retry_after: int = DEFAULT_RETRY_AFTER
    principal: PrincipalOf | None = None
    caller_headers: Iterable[str] = DEFAULT_CALLER_HEADERS
    caller_cookies: Iterable[str] = ()
    per_caller: bool = True

    def admission(self) -> Admission:
        """The settings checked (a ``ConfigurationError`` names the wrong one) and turned into the
        :class:`Admission` the middlewares decide each request with."""
        scope = self.scope
        fixed: str | None = None
        if scope is None:
            fixed = DEFAULT_HTTP_SCOPE
        elif isinstance(scope, str):
            try:
                fixed = check_scope(scope)
            except InvalidKeyError as exc:
                raise ConfigurationError(str(exc)) from None
        elif not callable(scope):
            raise ConfigurationError(
                f"scope must be a str or a callable of the request, got {type(scope).__name__}"
            )
        if isinstance(self.methods, str):
            raise ConfigurationError('methods is a collection of names, e.g. ("POST", "PATCH")')
        methods = frozenset(m.upper() for m in self.methods)
        if not methods or not all(isinstance(m, str) and m.isalpha() for m in methods):
            raise ConfigurationError(f"methods must be HTTP method names, got {self.methods!r}")
        for name in ("max_request_bytes", "max_response_bytes", "retry_after"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"{name} must be a positive int, got {value!r}")
        if isinstance(self.stored_headers, str):
            raise ConfigurationError("stored_headers is a collection of header names")
        caller_headers, caller_cookies = self._caller()
        return Admission(
            fixed_scope=fixed,
            scope_of=None if fixed is not None else scope,  # type: ignore[arg-type]
            require_key=bool(self.require_key),
            methods=methods,
            max_request_bytes=self.max_request_bytes,
            max_response_bytes=self.max_response_bytes,
            stored_headers=frozenset(h.lower() for h in self.stored_headers),
            retry_after=self.retry_after,
            principal=self.principal if self.per_caller else None,
            caller_headers=caller_headers,
            caller_cookies=caller_cookies,
        )

    def _caller(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The checked header and cookie names that identify the caller (none when
        ``per_caller`` is off or a ``principal`` callable decides)."""
        if not isinstance(self.per_caller, bool):
            raise ConfigurationError(f"per_caller must be a bool, got {self.per_caller!r}")
        if self.principal is not None and not callable(self.principal):
            raise ConfigurationError(
                "principal must be a callable of the request returning the caller's identity "
                f"(a str, or None for an anonymous caller), got {type(self.principal).__name__}"
            )
        if not self.per_caller and self.principal is not None:
            raise ConfigurationError(
                "per_caller=False shares stored responses among callers; it cannot go with a "
                "principal callable"
            )
        names: list[tuple[str, ...]] = []
        for field_name in ("caller_headers", "caller_cookies"):
            value = getattr(self, field_name)
            if (
                isinstance(value, str)
                or not isinstance(value, Iterable)
                or not all(isinstance(n, str) and n for n in value)
            ):
                raise ConfigurationError(
                    f"{field_name} is a collection of names, e.g. ('authorization',); got {value!r}"
                )
            names.append(tuple(value))
        headers = tuple(sorted({h.lower() for h in names[0]}))
        cookies = tuple(sorted(set(names[1])))
        if not self.per_caller or self.principal is not None:
            return (), ()
        if not headers and not cookies:
            raise ConfigurationError(
                "with no caller_headers and no caller_cookies nothing tells callers apart: "
                "name the credentials, pass principal=, or share responses among callers "
                "explicitly with per_caller=False"
            )
        return headers, cookies


@dataclass(frozen=True, slots=True)
class Admission:
    """Validated settings: which requests are covered, and how their responses are kept."""

    fixed_scope: str | None
    scope_of: ScopeOf | None
    require_key: bool
    methods: frozenset[str]
    max_request_bytes: int
    max_response_bytes: int
    stored_headers: frozenset[str]
    retry_after: int
    principal: PrincipalOf | None = None
    caller_headers: tuple[str, ...] = ()
    caller_cookies: tuple[str, ...] = ()

    def caller_of(self, request: Request) -> str | None:
        """What the fingerprint covers of the caller: a digest of its identity (``principal``)
        or of its credentials (``caller_headers``, ``caller_cookies``); ``None`` for a caller
        that shows none, or when responses are shared among callers (``per_caller=False``).

        A digest, so that neither the key's stored fingerprint nor anything derived from it
        holds a credential.
        """
        parts: list[str] = []
        if self.principal is not None:
            identity = self.principal(request)
            if identity is None:
                return None
            if not isinstance(identity, str):
                raise ConfigurationError(
                    "the principal callable must return a str (the caller's identity) or None, "
                    f"got {type(identity).__name__}"
                )
            parts.append(f"principal:{len(identity)}:{identity}")
        else:
            for name in self.caller_headers:
                for value in request.headers.getall(name):
                    parts.append(f"header:{len(name)}:{name}{len(value)}:{value}")
            if self.caller_cookies:
                jar = cookies_of(request.headers.getall("cookie"))
                for name in self.caller_cookies:
                    for value in jar.get(name, ()):
                        parts.append(f"cookie:{len(name)}:{name}{len(value)}:{value}")
        if not parts:
            return None
        text = "".join(parts).encode("utf-8", "surrogatepass")
        return "caller:sha256:" + hashlib.sha256(text).hexdigest()

    def admit(self, request: Request) -> Covered | None:
        """The ``(scope, key)`` a request runs under; ``None`` to pass it through untouched
        (a method not covered, or no key where none is required). Raises :class:`Refused`."""
        if request.method.upper() not in self.methods:
            return None
        key = parse_key(request.headers.getall(IDEMPOTENCY_KEY_HEADER))
        if key is None:
            if self.require_key:
                raise Refused(missing_key())
            return None
        if self.fixed_scope is not None:
            return Covered(self.fixed_scope, key)
        assert self.scope_of is not None
        try:
            scope = self.scope_of(request)
        except Exception as exc:
            # e.g. ``lambda r: r.headers["x-tenant"]`` on a request without the header: the
            # request lacks what the scope is made of, which is the client's to fix.
            if isinstance(exc, MissingHeader):
                detail = (
                    f"the request has no {shown(exc.name)} header, which this endpoint's "
                    "idempotency scope is made of: send it"
                )
            else:
                detail = (
                    "the idempotency scope could not be derived from the request "
                    f"({type(exc).__name__}); send the headers this endpoint requires"
                )
            raise Refused(
                Problem(400, "idempotency-scope-invalid", "Invalid idempotency scope", detail)
            ) from None
        try:
            check_scope(scope)
        except InvalidKeyError as exc:
            raise Refused(
                Problem(400, "idempotency-scope-invalid", "Invalid idempotency scope", str(exc))
            ) from None
        return Covered(scope, key)

    def check_declared_length(self, content_length: str | None) -> None:
        """Refuse (413) a body whose declared length is over the limit, before reading it."""
        if content_length is not None:
            try:
                declared = int(content_length)
            except ValueError:
                return  # the server decides what a malformed length means
            if declared > self.max_request_bytes:
                raise Refused(request_too_large(self.max_request_bytes))


def cookies_of(fields: Iterable[str]) -> dict[str, list[str]]:
    """The cookies of ``Cookie`` request fields (RFC 6265: ``name=value`` pairs separated by
    ``;``), every value of a repeated name kept, in order. Pairs without ``=`` are skipped."""
    jar: dict[str, list[str]] = {}
    for field_value in fields:
        for pair in field_value.split(";"):
            name, equals, value = pair.strip().partition("=")
            if equals and name:
                jar.setdefault(name.strip(), []).append(value.strip())
    return jar
