"""A bare ASGI app behind ``outbox.http.asgi.IdempotencyMiddleware``: the ASGI twin of
``tests/apps/http_raw_wsgi.py`` (served by uvicorn)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from outbox import AsyncOutbox, OutboxConfig
from outbox.http.asgi import IdempotencyMiddleware
from tests.apps import cache_prefix, database_url, redis_url

aob = AsyncOutbox(
    database_url(), redis_url=redis_url(), config=OutboxConfig(cache_prefix=cache_prefix())
)


async def echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = json.dumps({
        "method": scope["method"],
        "path": scope["path"],
        "query": scope.get("query_string", b"").decode("latin-1"),
        "nonce": uuid.uuid4().hex,
    }).encode()  # fmt: skip
    await send({
        "type": "http.response.start",
        "status": 200,
        "headers": [(b"content-type", b"application/json")],
    })  # fmt: skip
    await send({"type": "http.response.body", "body": body})


app = IdempotencyMiddleware(echo, aob, methods=("POST", "PATCH"), require_key=True)
