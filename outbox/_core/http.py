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
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from outbox._core.http_answers import Problem, Refused, Response, invalid_key
from outbox._core.validate import MAX_KEY_LENGTH, check_key
from outbox.errors import (
    InvalidKeyError,
)

IDEMPOTENCY_KEY_HEADER: Final = "idempotency-key"
REPLAYED_HEADER: Final = "idempotent-replayed"

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


# -- the key --------------------------------------------------------------------------------


def parse_sf_string(text: str) -> str:
    """The value of an RFC 8941 sf-string (``"..."`` with ``\\"`` and ``\\\\`` escapes).

    Raises :class:`Refused` (400) for anything else, parameters after the string included.
    """
    if not text.startswith('"'):
        raise invalid_key("a structured-field string starts with a double quote")
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
            raise invalid_key('in a structured-field string, "\\" may only escape \'"\' or "\\"')
        if char == '"':
            if i != end:
                raise invalid_key(
                    "unexpected characters after the structured-field string (parameters are "
                    "not supported)"
                )
            return "".join(out)
        if not " " <= char <= "~":
            raise invalid_key("a structured-field string holds printable ASCII only")
        out.append(char)
    raise invalid_key("the structured-field string has no closing double quote")


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
        raise invalid_key(f"the request has {len(values)} Idempotency-Key fields; {_SEVERAL_KEYS}")
    raw = values[0].strip(" \t")
    if raw.startswith('"'):
        key = parse_sf_string(raw)
    else:
        try:
            key = raw.encode("latin-1").decode("utf-8")
        except (UnicodeEncodeError, UnicodeDecodeError):
            raise invalid_key("the Idempotency-Key is not valid UTF-8") from None
    if not key:
        raise invalid_key("the Idempotency-Key is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise invalid_key(
            f"the Idempotency-Key is {len(key)} characters long; the limit is {MAX_KEY_LENGTH}"
        )
    try:
        check_key(key)
    except InvalidKeyError:
        raise invalid_key("the Idempotency-Key contains control characters") from None
    return key


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
