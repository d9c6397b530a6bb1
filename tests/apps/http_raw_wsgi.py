"""A bare WSGI app behind ``outbox.http.wsgi.IdempotencyMiddleware`` for the request-target and
method tests: ``POST`` and ``PATCH`` of any path echo the method, path and query the app saw
with a fresh nonce (a replay repeats the nonce); a key is required. Served by gunicorn,
Werkzeug's server or wsgiref (``python -m tests.apps.serve_raw``)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from outbox import Outbox, OutboxConfig
from outbox.http.wsgi import IdempotencyMiddleware
from tests.apps import cache_prefix, database_url, redis_url

ob = Outbox(database_url(), redis_url=redis_url(), config=OutboxConfig(cache_prefix=cache_prefix()))


def echo(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    body = json.dumps({
        "method": environ["REQUEST_METHOD"],
        "path": environ.get("PATH_INFO", ""),
        "query": environ.get("QUERY_STRING", ""),
        "nonce": uuid.uuid4().hex,
    }).encode()  # fmt: skip
    start_response("200 OK", [("Content-Type", "application/json")])
    return [body]


app = IdempotencyMiddleware(echo, ob, methods=("POST", "PATCH"), require_key=True)
