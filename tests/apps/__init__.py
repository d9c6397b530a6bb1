"""Small web applications the HTTP tests run under real servers (uvicorn, gunicorn).

Both serve the same endpoints behind the idempotency middleware, configured from the
environment (``OUTBOX_DATABASE_URL``, ``OUTBOX_REDIS_URL``, ``OUTBOX_TEST_CACHE_PREFIX``):

* ``POST /orders`` -- one row in ``orders`` and one ``orders.created`` event, in the request's
  unit of work; answers 201 with a ``Location`` and a body carrying a fresh nonce, so a rerun of
  the handler could never produce the same bytes. Test-only headers (outside the fingerprint):
  ``X-Delay`` (seconds to hold the unit of work open), ``X-Fail: raise`` (raise after writing),
  ``X-Fail: 500`` (answer 500 after writing), ``X-Status`` (answer this status after writing),
  ``X-Pad`` (add a field of this many bytes to the body).
* ``POST /stream`` -- a streaming response.
* ``GET /probe`` -- whether the request has a unit of work (it must not).
* ``GET /stats`` -- how many statements the middleware's engine has run.

The scope is the ``X-Tenant`` header (``tenant-<name>``, ``tenant-none`` without it), and a key
is required. With ``OUTBOX_TEST_SPANS_FILE`` set, the app records its spans with the
OpenTelemetry SDK into that file (``tests/fixtures/tracing.py``).
"""

from __future__ import annotations

import os

if os.environ.get("OUTBOX_TEST_SPANS_FILE"):
    from tests.fixtures.tracing import export_to_file

    export_to_file(os.environ["OUTBOX_TEST_SPANS_FILE"])

INSERT_ORDER = "INSERT INTO orders (order_key, amount) VALUES (:k, :a) RETURNING id"


def database_url() -> str:
    return os.environ["OUTBOX_DATABASE_URL"]


def redis_url() -> str | None:
    return os.environ.get("OUTBOX_REDIS_URL") or None


def cache_prefix() -> str:
    return os.environ.get("OUTBOX_TEST_CACHE_PREFIX", "outbox")


def tenant(request: object) -> str:
    headers = request.headers  # type: ignore[attr-defined]
    return "tenant-" + headers.get("x-tenant", "none")
