"""The HTTP door's decisions, written once for the ASGI and the WSGI middleware, without I/O.

Invariant: a stored response is replayed only for a request with the same fingerprint, which
covers the caller (:meth:`Admission.caller_of`): a stored response is only for its own caller.
Every refusal is an ``application/problem+json`` answer (RFC 9457, :class:`Problem`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http
import json
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from outbox._core.validate import MAX_KEY_LENGTH, check_key, check_scope, shown
from outbox.errors import (
    ConfigurationError,
    InvalidKeyError,
    KeyInProgress,
    KeyReuseError,
    OutboxError,
    PreviouslyFailed,
)

IDEMPOTENCY_KEY_HEADER: Final = "idempotency-key"
REPLAYED_HEADER: Final = "idempotent-replayed"
PROBLEM_CONTENT_TYPE: Final = "application/problem+json"
PROBLEM_TYPE_BASE: Final = "tag:outbox-kit,2026:http/"

DEFAULT_METHODS: Final = ("POST", "PATCH")
DEFAULT_HTTP_SCOPE: Final = "http"
DEFAULT_MAX_REQUEST_BYTES: Final = 1024 * 1024
DEFAULT_MAX_RESPONSE_BYTES: Final = 1024 * 1024
DEFAULT_RETRY_AFTER: Final = 1
# Request headers that carry the caller's credentials: the fingerprint covers their digest, so
# a response stored for one caller is never replayed to another who presents the same key.
DEFAULT_CALLER_HEADERS: Final = ("authorization",)

# Response headers stored with the response and sent again on a replay: those that describe
# the stored body or the created resource. Not stored: per-response headers (date, server,
# request ids), hop-by-hop and framing headers (content-length is recomputed), and set-cookie,
# whose credentials must not be handed to whoever repeats a request.
DEFAULT_STORED_HEADERS: Final = frozenset({
    "content-type", "content-encoding", "content-language", "content-disposition",
    "content-location", "location", "link", "etag", "last-modified", "cache-control",
    "expires", "vary",
})  # fmt: skip

# 4xx answers that are not the handler's verdict on the request itself but on the moment or
# the credentials: the client retries the same request with the same key and must get a fresh
# run, not this answer again. Every other 2xx, 3xx and 4xx is stored; no 5xx is.
NOT_STORED_4XX: Final = frozenset({401, 403, 408, 409, 423, 425, 429})

_SEVERAL_KEYS = "send one Idempotency-Key field"


# -- requests -------------------------------------------------------------------------------


class MissingHeader(KeyError):
    """``headers[name]`` of a header the request does not carry; names it for the 400."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class Headers(Mapping[str, str]):
    """Request headers as a case-insensitive mapping; repeated fields are joined with ``", "``.

    Values are ``str`` as the servers give them (ISO-8859-1 decoded bytes); :meth:`getall`
    keeps repeated fields apart.
    """

    __slots__ = ("_fields",)

    def __init__(self, pairs: Iterable[tuple[str, str]]) -> None:
        fields: dict[str, list[str]] = {}
        for name, value in pairs:
            fields.setdefault(name.lower(), []).append(value)
        self._fields = fields

    def __getitem__(self, name: str) -> str:
        try:
            return ", ".join(self._fields[name.lower()])
        except KeyError:
            raise MissingHeader(name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._fields

    def getall(self, name: str) -> list[str]:
        """Every value of the field ``name``, in the order received (empty when absent)."""
        return list(self._fields.get(name.lower(), ()))

    def __repr__(self) -> str:
        return f"Headers({sorted(self._fields)!r})"


@dataclass(frozen=True, slots=True)
class Request:
    """What a ``scope`` callable sees of a request: ``method`` (upper case), ``path`` (decoded,
    without the query string), ``query`` (the raw query string) and ``headers`` (a
    case-insensitive mapping). ``raw_path`` is the path as the client sent it (percent-encoding
    kept, ISO-8859-1 text), when the server kept it."""

    method: str
    path: str
    headers: Headers
    query: str = ""
    raw_path: str | None = None

    @property
    def target(self) -> str:
        """What the fingerprint covers of the request target: the raw path and the raw query
        string, each length-prefixed (see :func:`request_target`)."""
        raw = self.raw_path
        if raw is None:
            raw = quoted_path(self.path.encode("utf-8", "surrogateescape"))
        return request_target(raw, self.query)


def request_target(raw_path: str, query: str) -> str:
    """The request target as the fingerprint covers it: the path as sent and the query string,
    each length-prefixed.

    The raw path keeps what decoding would merge: ``/transfer%3Famount=1`` (one path) and
    ``/transfer?amount=1`` (a path and a query), ``/a%2Fb`` and ``/a/b``, ``%FF`` and ``%FE``
    (both undecodable as UTF-8) are different requests, so a key reused across them is a
    ``key-reuse`` refusal, never another request's stored response.
    """
    return f"{len(raw_path)}:{raw_path}{len(query)}:{query}"


def quoted_path(path: bytes) -> str:
    """A decoded path percent-encoded again, for servers that do not keep the raw one (every
    byte but ``/`` and unreserved characters encoded). ``%2F`` and ``/`` are alike to it."""
    return urllib.parse.quote(path, safe="/")


# -- problems (RFC 9457) --------------------------------------------------------------------


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


def _invalid_key(detail: str) -> Refused:
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


# -- the key --------------------------------------------------------------------------------


def parse_sf_string(text: str) -> str:
    """The value of an RFC 8941 sf-string (``"..."`` with ``\\"`` and ``\\\\`` escapes).

    Raises :class:`Refused` (400) for anything else, parameters after the string included.
    """
    if not text.startswith('"'):
        raise _invalid_key("a structured-field string starts with a double quote")
    out: list[str] = []
    i, end = 1, len(text)
    while i < end:
        char = text[i]
        i += 1
        if char == "\\":
            if i < end and text[i] in '"\\':
                out.append(text[i])
                i += 1
                continue
            raise _invalid_key('in a structured-field string, "\\" may only escape \'"\' or "\\"')
        if char == '"':
            if i != end:
                raise _invalid_key(
                    "unexpected characters after the structured-field string (parameters are "
                    "not supported)"
                )
            return "".join(out)
        if not " " <= char <= "~":
            raise _invalid_key("a structured-field string holds printable ASCII only")
        out.append(char)
    raise _invalid_key("the structured-field string has no closing double quote")


def parse_key(values: Sequence[str]) -> str | None:
    """The idempotency key of a request, ``None`` without an ``Idempotency-Key`` field.

    ``values`` are the field's values as the server decoded them (ISO-8859-1). A value that
    starts with a double quote is an RFC 8941 sf-string and the key is its content; any other
    value is the key as sent (UTF-8). Empty, longer than 255 characters, containing control
    characters, sent in several fields, or malformed: :class:`Refused` (400). Never raises
    anything else.
    """
    if not values:
        return None
    if len(values) > 1:
        raise _invalid_key(f"the request has {len(values)} Idempotency-Key fields; {_SEVERAL_KEYS}")
    raw = values[0].strip(" \t")
    if raw.startswith('"'):
        key = parse_sf_string(raw)
    else:
        try:
            key = raw.encode("latin-1").decode("utf-8")
        except (UnicodeEncodeError, UnicodeDecodeError):
            raise _invalid_key("the Idempotency-Key is not valid UTF-8") from None
    if not key:
        raise _invalid_key("the Idempotency-Key is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise _invalid_key(
            f"the Idempotency-Key is {len(key)} characters long; the limit is {MAX_KEY_LENGTH}"
        )
    try:
        check_key(key)
    except InvalidKeyError:
        raise _invalid_key("the Idempotency-Key contains control characters") from None
    return key


# -- settings and admission -----------------------------------------------------------------

ScopeOf = Callable[[Request], str]
PrincipalOf = Callable[[Request], "str | None"]


@dataclass(frozen=True, slots=True)
class Covered:
    """A request that runs in a unit of work of ``(scope, key)``."""

    scope: str
    key: str


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """The middlewares' options (see :mod:`outbox.http`), checked once by :meth:`validate`."""

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

    def validate(self) -> Admission:
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


# -- fingerprint ----------------------------------------------------------------------------


def fingerprint(method: str, target: str, body: bytes, caller: str | None = None) -> str:
    """The request fingerprint a reused key must match: SHA-256 over method, target (path
    and query string) and body, each length-prefixed so that no two requests share an input,
    then the caller (:meth:`Admission.caller_of`) when there is one."""
    head = f"{len(method)}:{method}{len(target)}:{target}{len(body)}:"
    digest = hashlib.sha256(head.encode("utf-8", "surrogatepass"))
    digest.update(body)
    if caller is not None:
        digest.update(f"{len(caller)}:{caller}".encode("utf-8", "surrogatepass"))
    return "sha256:" + digest.hexdigest()


# -- responses ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Response:
    """A complete HTTP response: status, header pairs (``str``, ISO-8859-1) and body."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes


def is_stored(status: int) -> bool:
    """Whether a response with ``status`` is the request's outcome, committed with its effects
    and replayed to every duplicate. 5xx and the 4xx of :data:`NOT_STORED_4XX` are not: their
    unit of work is rolled back and the key stays free for the retry."""
    return 200 <= status < 500 and status not in NOT_STORED_4XX


def is_streaming(pieces: int, headers: Iterable[tuple[str, str]]) -> bool:
    """A response body sent in more than one piece without a ``content-length`` header."""
    return pieces > 1 and not any(name.lower() == "content-length" for name, _ in headers)


def encode_response(
    status: int, headers: Iterable[tuple[str, str]], body: bytes, stored_headers: frozenset[str]
) -> dict[str, Any]:
    """The JSON object stored as the unit of work's result.

    ``{"body": "...", "status": 201, "headers": [["content-type", "application/json"], ...],
    "encoding": "utf-8"}`` -- the body as text when it is UTF-8 without NUL characters (JSON,
    HTML, plain text: readable in SQL and a quarter smaller), else ``"encoding": "base64"``.
    Headers keep their order and repetitions; only those in ``stored_headers`` are kept. The
    keys come in ``jsonb``'s own order, so PostgreSQL stores the object as it is
    (:mod:`outbox._core.results`).
    """
    kept = [[name.lower(), value] for name, value in headers if name.lower() in stored_headers]
    text: str | None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and "\x00" not in text:
        return {"body": text, "status": status, "headers": kept, "encoding": "utf-8"}
    return {
        "body": base64.b64encode(body).decode("ascii"),
        "status": status,
        "headers": kept,
        "encoding": "base64",
    }


def _not_a_response() -> Refused:
    return Refused(
        Problem(
            500,
            "stored-result-invalid",
            "Stored result is not an HTTP response",
            "the result stored with this idempotency key was not written by the HTTP "
            "middleware (is the scope shared with another door?)",
        )
    )


def decode_response(result: Any) -> Response:
    """The response stored by :func:`encode_response`, byte for byte; :class:`Refused` (500)
    for a result that is not one."""
    if not isinstance(result, dict):
        raise _not_a_response()
    status, headers, body = result.get("status"), result.get("headers"), result.get("body")
    encoding = result.get("encoding")
    if (
        not isinstance(status, int)
        or not 100 <= status <= 599
        or not isinstance(headers, list)
        or not isinstance(body, str)
    ):
        raise _not_a_response()
    pairs: list[tuple[str, str]] = []
    for pair in headers:
        if not (
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)
        ):
            raise _not_a_response()
        pairs.append((pair[0], pair[1]))
    if encoding == "utf-8":
        data = body.encode("utf-8")
    elif encoding == "base64":
        try:
            data = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise _not_a_response() from None
    else:
        raise _not_a_response()
    return Response(status, pairs, data)


def replay_headers(response: Response) -> list[tuple[str, str]]:
    """The headers of a replayed response: the stored ones, its length and the replay mark."""
    return [
        *response.headers,
        ("content-length", str(len(response.body))),
        (REPLAYED_HEADER, "true"),
    ]


def status_line(status: int) -> str:
    """``"201 Created"``: a WSGI status line for ``status``."""
    try:
        return f"{status} {http.HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Unknown"
