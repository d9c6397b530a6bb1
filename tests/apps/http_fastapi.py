"""FastAPI under uvicorn with ``outbox.http.fastapi``: the unit of work is a dependency in the
request's own session, committed before the response (no middleware).

* ``POST /orders`` -- one row in ``orders`` and one ``orders.created`` event; 201 with the
  order id. Test-only headers: ``X-Fail: commit`` also writes a row that breaks a deferred
  foreign key, so the commit itself fails; ``X-Hold: N`` takes the transaction-scoped advisory
  lock N (the test holds it to keep the unit of work open); ``X-Fail: raise`` raises after
  writing.
* ``POST /open`` -- ``Idempotency-Key`` optional; without one, ``current_unit_of_work()`` is
  called anyway (a 400 problem, not a 500).
* ``POST /middleware/open`` -- the same behind ``IdempotencyMiddleware(require_key=False)``.
* ``GET /probe`` -- readiness.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import FastAPI, Request
from sqlalchemy.ext.asyncio import AsyncSession

from outbox import AsyncOutbox, AsyncUnitOfWork, OutboxConfig
from outbox.http import current_unit_of_work
from outbox.http.asgi import IdempotencyMiddleware
from outbox.http.fastapi import add_exception_handlers, unit_of_work
from tests.apps import INSERT_ORDER, cache_prefix, database_url, redis_url, tenant

aob = AsyncOutbox(
    database_url(), redis_url=redis_url(), config=OutboxConfig(cache_prefix=cache_prefix())
)


@asynccontextmanager
async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    yield
    await aob.close()


async def session() -> AsyncIterator[AsyncSession]:
    async with AsyncSession(aob.engine) as own:
        yield own


app = FastAPI(lifespan=lifespan)
add_exception_handlers(app, retry_after=2)


@app.post("/orders", status_code=201)
async def create_order(
    request: Request,
    uow: Annotated[AsyncUnitOfWork, unit_of_work(aob, session=session, scope=tenant)],
) -> Any:
    if uow.replayed:
        return uow.result
    payload = await request.json()
    if hold := request.headers.get("x-hold"):
        await uow.connection.execute(sa.text("SELECT pg_advisory_xact_lock(:n)"), {"n": int(hold)})
    result = await uow.connection.execute(
        sa.text(INSERT_ORDER), {"k": uow.key, "a": payload["amount"]}
    )
    order_id = result.scalar_one()
    uow.publish("orders.created", {"order_id": order_id}, key=str(order_id))
    fail = request.headers.get("x-fail")
    if fail == "commit":
        await uow.connection.execute(sa.text("INSERT INTO order_lines (order_id) VALUES (-1)"))
    elif fail == "raise":
        raise RuntimeError("the handler failed after writing")
    uow.result = {"order_id": order_id}
    return uow.result


@app.post("/open")
async def open_endpoint(
    uow: Annotated[AsyncUnitOfWork | None, unit_of_work(aob, require_key=False)],
) -> Any:
    current_unit_of_work()  # outside the middleware there is none: NoUnitOfWork, a 400
    return {"ok": True}


# The same kind of endpoint behind the ASGI middleware, where a key is optional.
behind_middleware = FastAPI()
behind_middleware.add_middleware(IdempotencyMiddleware, outbox=aob, require_key=False)


@behind_middleware.post("/open")
async def open_behind_middleware() -> Any:
    current_unit_of_work()  # no key was sent: NoUnitOfWork, which the middleware answers 400
    return {"ok": True}


app.mount("/middleware", behind_middleware)


@app.get("/probe")
async def probe() -> dict[str, bool]:
    return {"ok": True}
