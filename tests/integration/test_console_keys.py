"""The console's key page finds the events a key's unit of work wrote -- whatever their message
keys -- says which are pending, which parked, and that delivered ones have left the outbox; it
never counts another unit of work's events as this key's (a real console over TCP, real
PostgreSQL, units of work through the public API)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable

import httpx
import sqlalchemy as sa

from outbox import Outbox
from outbox.schema import tables
from tests.fixtures.console import ConsoleServer


def _section(page: str, table_id: str) -> str:
    found = re.search(rf'<table id="{table_id}">(.*?)</table>', page, flags=re.DOTALL)
    return found.group(1) if found else ""


def _summary(page: str) -> str:
    found = re.search(r'<p class="meta" id="unit-events-summary">(.*?)</p>', page, re.DOTALL)
    assert found, "no summary of the unit of work's events"
    return re.sub(r"<[^>]+>", "", found.group(1))


def test_a_key_page_lists_its_unit_of_works_events_pending_parked_and_delivered(
    console_server: Callable[..., ConsoleServer], engine: sa.Engine
) -> None:
    outbox = Outbox(engine)
    with outbox.unit_of_work("req-7", scope="checkout") as uow:
        accepted = uow.publish("orders", {"order": 7}, key="order-7")
        mailed = uow.publish("emails", {"to": "ada"}, key="customer-1")
        uow.result = {"order_id": 7}
    with outbox.unit_of_work("req-8", scope="checkout") as other:
        foreign = other.publish("orders", {"order": 8}, key="order-8")
    with outbox.unit_of_work("req-9", scope="checkout") as quiet:
        quiet.result = {"nothing": "published"}
    t = tables(None).outbox
    with engine.begin() as conn:  # the relay parked the e-mail
        conn.execute(
            sa.update(t)
            .where(t.c.event_id == mailed)
            .values(parked_at=sa.func.now(), last_error="UNKNOWN_TOPIC_OR_PART", attempts=3)
        )
    server = console_server()
    with httpx.Client(base_url=server.url) as client:
        page = client.get("/keys", params={"scope": "checkout", "key": "req-7"}).text
        mine = _section(page, "key-events")
        assert str(accepted) in mine and str(mailed) in mine
        assert str(foreign) not in page
        assert re.search(rf"{mailed}.*?parked</a>: UNKNOWN_TOPIC_OR_PART", mine, re.DOTALL)
        assert re.search(rf"{accepted}.*?<td>pending</td>", mine, re.DOTALL)
        assert _summary(page).startswith("2 still in the outbox (1 pending, 1 parked)")

        with engine.begin() as conn:  # the relay delivered the order event: its row is gone
            conn.execute(sa.delete(t).where(t.c.event_id == accepted))
        page = client.get("/keys", params={"scope": "checkout", "key": "req-7"}).text
        assert str(accepted) not in page and str(mailed) in _section(page, "key-events")
        assert "any other event it published was delivered and has left" in _summary(page)

        page = client.get("/keys", params={"scope": "checkout", "key": "req-9"}).text
        assert _section(page, "key-events") == ""
        assert _summary(page).startswith("none is still in the outbox: it published none, or")
    outbox.close()


def test_events_that_only_name_the_key_are_listed_apart(
    console_server: Callable[..., ConsoleServer], engine: sa.Engine
) -> None:
    outbox = Outbox(engine)
    with outbox.unit_of_work("req-1", scope="checkout") as uow:
        uow.result = {"ok": True}
    # Another unit of work's event whose message key happens to be the idempotency key.
    with outbox.unit_of_work(str(uuid.uuid4()), scope="checkout") as other:
        naming = other.publish("orders", {"n": 1}, key="req-1")
    server = console_server()
    with httpx.Client(base_url=server.url) as client:
        page = client.get("/keys", params={"scope": "checkout", "key": "req-1"}).text
    assert str(naming) in _section(page, "key-named-events")
    assert _section(page, "key-events") == ""
    outbox.close()
