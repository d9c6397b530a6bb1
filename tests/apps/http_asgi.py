"""FastAPI under uvicorn, behind ``outbox.http.asgi.IdempotencyMiddleware`` (see the package
docstring for the endpoints)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import sqlalchemy as sa
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from outbox import AsyncOutbox, AsyncUnitOfWork, OutboxConfig
from outbox.errors import NoUnitOfWork
from outbox.http import current_unit_of_work
from outbox.http.asgi import IdempotencyMiddleware
from tests.apps import INSERT_ORDER, cache_prefix, database_url, redis_url, tenant

aob = AsyncOutbox(
    database_url(), redis_url=redis_url(), config=OutboxConfig(cache_prefix=cache_prefix())
)
statements = [0]
checkouts = [0]  # PostgreSQL connections taken from the pool, whoever sends SQL on them


def _count(*_: Any) -> None:
    statements[0] += 1


def _checkout(*_: Any) -> None:
    checkouts[0] += 1


sa.event.listen(aob.engine.sync_engine, "before_cursor_execute", _count)
sa.event.listen(aob.engine.sync_engine, "checkout", _checkout)


@asynccontextmanager
async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    yield
    await aob.close()


app = FastAPI(lifespan=lifespan)
app.add_middleware(IdempotencyMiddleware, outbox=aob, scope=tenant, require_key=True)


@app.post("/orders")
async def create_order(request: Request) -> Response:
    payload = await request.json()
    uow = current_unit_of_work()
    assert isinstance(uow, AsyncUnitOfWork)
    result = await uow.connection.execute(
        sa.text(INSERT_ORDER), {"k": uow.key, "a": payload["amount"]}
    )
    order_id = result.scalar_one()
    uow.publish("orders.created", {"order_id": order_id}, key=str(order_id))
    if delay := request.headers.get("x-delay"):
        await asyncio.sleep(float(delay))
    fail = request.headers.get("x-fail")
    if fail == "raise":
        raise RuntimeError("the handler failed after writing")
    if fail == "500":
        return JSONResponse({"error": "try again"}, status_code=500)
    status = int(request.headers.get("x-status", "201"))
    body = {"order_id": order_id, "amount": payload["amount"], "nonce": uuid.uuid4().hex}
    if pad := request.headers.get("x-pad"):
        body["pad"] = "x" * int(pad)
    return JSONResponse(body, status_code=status, headers={"Location": f"/orders/{order_id}"})


@app.post("/stream")
async def stream() -> StreamingResponse:
    async def chunks() -> AsyncIterator[bytes]:
        for i in range(3):
            yield f"chunk {i}\n".encode()

    return StreamingResponse(chunks(), media_type="text/plain")


@app.get("/probe")
async def probe() -> dict[str, bool]:
    try:
        current_unit_of_work()
    except NoUnitOfWork:
        return {"uow": False}
    return {"uow": True}


@app.get("/stats")
async def stats() -> dict[str, int]:
    return {"statements": statements[0], "checkouts": checkouts[0]}


# The same routes with the middleware outside FastAPI (and its own request span): the
# middleware's request span is then the first one (tests/e2e/test_tracing_e2e.py).
_plain = FastAPI(lifespan=lifespan)
_plain.include_router(app.router)
outer = IdempotencyMiddleware(_plain, outbox=aob, scope=tenant, require_key=True)
