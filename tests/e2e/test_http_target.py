"""The HTTP door through real servers: the fingerprint covers the request target as the
client sent it, and methods are covered whatever their case.

Each pair below decodes to the same path and query, so a fingerprint over the decoded target
gave the second request the first one's stored response; over the raw target it is a reused
key (422). A method in lower or mixed case is routed like its upper-case name by Werkzeug and
h11, so it must be covered like it: without a key it is refused, with one it is replayed.
"""

from __future__ import annotations

import http.client
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from outbox._core.http import (
    REPLAYED_HEADER,
)
from outbox._core.http_answers import (
    PROBLEM_TYPE_BASE,
)
from tests.fixtures.common import ServiceUnavailable, unavailable
from tests.fixtures.web import HOW_HTTP, WebServer


@dataclass(frozen=True)
class Server:
    flavour: str
    argv: list[str]
    keeps_raw_path: bool  # whether %2F and / reach the middleware apart
    any_case_methods: bool  # whether the server passes a lower-case method to the app


SERVERS = {
    "uvicorn": Server(
        "asgi",
        ["uvicorn", "tests.apps.http_raw_asgi:app", "--http", "h11", "--host", "127.0.0.1",
         "--port", "{port}", "--log-level", "warning", "--no-access-log"],
        keeps_raw_path=True,
        any_case_methods=True,
    ),
    "gunicorn": Server(
        "wsgi",
        ["gunicorn", "--worker-class", "gthread", "--workers", "1", "--threads", "4",
         "--bind", "127.0.0.1:{port}", "--log-level", "warning", "tests.apps.http_raw_wsgi:app"],
        keeps_raw_path=True,
        any_case_methods=False,  # gunicorn refuses methods that are not upper case (400)
    ),
    "werkzeug": Server(
        "wsgi", ["tests.apps.serve_raw", "werkzeug", "{port}"], True, any_case_methods=True
    ),
    "wsgiref": Server(
        "wsgi", ["tests.apps.serve_raw", "wsgiref", "{port}"], False, any_case_methods=True
    ),
}  # fmt: skip


@pytest.fixture(params=sorted(SERVERS))
def served(
    request: pytest.FixtureRequest, database_url: str, redis_url: str, redis_prefix: str
) -> Iterator[tuple[Server, WebServer]]:
    server = SERVERS[request.param]
    web = WebServer(
        server.flavour,
        {
            "OUTBOX_DATABASE_URL": database_url,
            "OUTBOX_REDIS_URL": redis_url,
            "OUTBOX_TEST_CACHE_PREFIX": redis_prefix,
        },
        argv=server.argv,
    )
    try:
        web.start()
    except ServiceUnavailable as exc:
        web.close()
        unavailable(f"HTTP server ({request.param})", str(exc), HOW_HTTP)
    try:
        yield server, web
    finally:
        web.stop()
        web.close()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> dict[str, str]:
        document: dict[str, str] = json.loads(self.body)
        return document


def _send(web: WebServer, method: str, target: str, key: str | None) -> Answer:
    """One request sent byte for byte as given (method case and target included)."""
    connection = http.client.HTTPConnection("127.0.0.1", web.port, timeout=30)
    try:
        connection.putrequest(method, target, skip_accept_encoding=True)
        if key is not None:
            connection.putheader("Idempotency-Key", key)
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", "2")
        connection.endheaders(b"{}")
        response = connection.getresponse()
        headers = {name.lower(): value for name, value in response.getheaders()}
        return Answer(response.status, headers, response.read())
    finally:
        connection.close()


def _reused(answer: Answer) -> bool:
    return (
        answer.status == 422 and answer.json["type"] == PROBLEM_TYPE_BASE + "idempotency-key-reused"
    )


PAIRS = [
    ("/transfer%3Famount=1", "/transfer?amount=1"),
    ("/a%2Fb", "/a/b"),
    ("/x%FF", "/x%FE"),
]


def test_targets_that_decode_alike_do_not_share_a_stored_response(
    served: tuple[Server, WebServer],
) -> None:
    server, web = served
    for first, second in PAIRS:
        if first == "/a%2Fb" and not server.keeps_raw_path:
            continue  # wsgiref decodes the path and keeps no raw form: documented in http.md
        key = f"k-{uuid.uuid4().hex}"
        ran = _send(web, "POST", first, key)
        assert ran.status == 200, (first, ran.body)
        again = _send(web, "POST", first, key)
        assert again.headers.get(REPLAYED_HEADER) == "true"
        assert again.json["nonce"] == ran.json["nonce"]
        other = _send(web, "POST", second, key)
        assert _reused(other), (first, second, other.status, other.body)


def test_methods_are_covered_whatever_their_case(served: tuple[Server, WebServer]) -> None:
    server, web = served
    if not server.any_case_methods:
        assert _send(web, "post", "/pay", None).status == 400  # refused by the server itself
        return
    # A key is required: a lower-case POST without one does not slip past.
    missing = _send(web, "post", "/pay", None)
    assert missing.status == 400
    assert missing.json["type"] == PROBLEM_TYPE_BASE + "idempotency-key-missing"
    # One key, three spellings of PATCH: the handler runs once.
    key = f"k-{uuid.uuid4().hex}"
    ran = _send(web, "pAtCh", "/pay", key)
    assert ran.status == 200 and REPLAYED_HEADER not in ran.headers
    for spelling in ("PATCH", "patch"):
        again = _send(web, spelling, "/pay", key)
        assert again.headers.get(REPLAYED_HEADER) == "true", (spelling, again.body)
        assert again.json["nonce"] == ran.json["nonce"]
