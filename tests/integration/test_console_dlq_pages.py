"""The console's dead-letters page over TCP (a real uvicorn process, real PostgreSQL and
broker): a page reads a budget of letters still to handle (handled ones use none of it), says
where it stopped and links to the next, so every dead letter is reachable; a well-formed group
id the page does not hold is a 400."""

from __future__ import annotations

import html
import re
import uuid
from collections.abc import Callable

import httpx
import pytest
import sqlalchemy as sa

from tests.fixtures.console import ADMIN_TOKEN, ConsoleServer, write_dead_letters
from tests.integration.test_console import BEARER, csrf_of, group_ids, handled_count

LIMIT = {"OUTBOX_CONSOLE_DLQ_LIMIT": "2"}


@pytest.fixture
def five_letters(kafka_bootstrap: str) -> str:
    return write_dead_letters(
        kafka_bootstrap,
        f"billing-{uuid.uuid4().hex[:8]}",
        [
            ("inv-1", KeyError("'inv-1' has no customer")),
            ("inv-2", KeyError("'inv-2' has no customer")),
            ("inv-3", KeyError("'inv-3' has no customer")),
            ("inv-4", ValueError("price -4 is negative")),
            ("inv-5", ValueError("price -5 is negative")),
        ],
    )


def counts(page: str) -> list[int]:
    return [
        int(n)
        for n in re.findall(r'<td class="mono">[0-9a-f]{12}</td><td class="num">(\d+)<', page)
    ]


def next_link(page: str) -> str | None:
    found = re.search(r'id="dlq-next" href="([^"]+)"', page)
    return html.unescape(found.group(1)) if found else None


def test_letters_past_the_budget_are_shown_once_the_ones_before_them_are_handled(
    console_server: Callable[..., ConsoleServer],
    kafka_bootstrap: str,
    five_letters: str,
    engine: sa.Engine,
) -> None:
    server = console_server(
        "--admin-token", ADMIN_TOKEN, "--bootstrap-servers", kafka_bootstrap, env=LIMIT
    )
    with httpx.Client(base_url=server.url, headers=BEARER) as client:
        page = client.get("/dlq", params={"topic": five_letters}).text
        assert counts(page) == [2]
        form = {"csrf": csrf_of(page), "topic": five_letters, "group": group_ids(page)[0]}
        done = client.post("/dlq/handled", data={**form, "confirmed": "2"})
        assert done.status_code == 303
        # Handled letters use none of the budget: the page reads on to the newer ones.
        page = client.get("/dlq", params={"topic": five_letters}).text
        assert sorted(counts(page)) == [1, 1]
        assert re.search(r'id="dlq-handled">2<', page)
    assert handled_count(engine) == 2


def test_a_page_that_stopped_says_where_and_its_next_page_holds_the_rest(
    console_server: Callable[..., ConsoleServer],
    kafka_bootstrap: str,
    five_letters: str,
) -> None:
    server = console_server(
        "--admin-token", ADMIN_TOKEN, "--bootstrap-servers", kafka_bootstrap, env=LIMIT
    )
    seen: list[int] = []
    with httpx.Client(base_url=server.url, headers=BEARER) as client:
        page = client.get("/dlq", params={"topic": five_letters}).text
        assert 'id="dlq-stopped"' in page
        assert "reading stopped after 2 dead letter(s) still to handle" in page
        assert "partition 0 from offset 2" in page
        assert next_link(page) == f"/dlq?topic={five_letters}&from=0%3A2"
        seen += counts(page)
        pages = 1
        while (link := next_link(page)) is not None:
            page = client.get(link).text
            seen += counts(page)
            pages += 1
            assert pages <= 5
        assert 'id="dlq-stopped"' not in page
        # A group of a later page is handled from that page (its forms carry where it starts).
        last = client.get("/dlq", params={"topic": five_letters, "from": "0:4"}).text
        assert counts(last) == [1]
        form = {
            "csrf": csrf_of(last), "topic": five_letters, "group": group_ids(last)[0],
            "from": "0:4", "confirmed": "1",
        }  # fmt: skip
        done = client.post("/dlq/handled", data=form)
        assert done.status_code == 303 and "from=0%3A4" in done.headers["location"]
        bad = client.get("/dlq", params={"topic": five_letters, "from": "0:x"})
        assert bad.status_code == 400 and "PARTITION:OFFSET" in bad.text
    assert sum(seen) == 5 and pages == 3


def test_a_well_formed_group_the_page_does_not_hold_is_a_400(
    console_server: Callable[..., ConsoleServer],
    kafka_bootstrap: str,
    five_letters: str,
    engine: sa.Engine,
) -> None:
    server = console_server("--admin-token", ADMIN_TOKEN, "--bootstrap-servers", kafka_bootstrap)
    with httpx.Client(base_url=server.url, headers=BEARER) as client:
        page = client.get("/dlq", params={"topic": five_letters}).text
        real = group_ids(page)[0]
        for action in ("handled", "redrive"):
            for groups in (["0123456789ab"], [real, "0123456789ab"]):
                form = {"csrf": csrf_of(page), "topic": five_letters, "group": groups}
                answer = client.post(f"/dlq/{action}", data=form)
                assert answer.status_code == 400, (action, answer.status_code)
                assert "0123456789ab is not among the dead letters" in answer.text
                assert 'id="confirm' not in answer.text
    assert handled_count(engine) == 0
