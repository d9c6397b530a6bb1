"""``outbox console`` over a relay fleet's databases, in a real browser against a real console
process, PostgreSQL and a fleet relay: the fleet's page lists every database (one down, one
unmigrated, one with a parked row, one served), the unhealthy first, and each opens that
database's own console, whose pages and links stay with that database."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.e2e.test_console_browser import VIEWPORT, shoot
from tests.fixtures.common import free_port, wait_for
from tests.fixtures.console import ConsoleServer
from tests.fixtures.postgres import DatabaseFactory
from tests.fixtures.relay import REPO, insert_rows


@pytest.fixture
def four(_database_factory: DatabaseFactory) -> Iterator[list[str]]:
    """Three migrated databases and an empty one (names)."""
    names = [_database_factory.create() for _ in range(3)]
    empty = f"fleet_console_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(_database_factory.admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{empty}"')
    admin.dispose()
    try:
        yield [*names, empty]
    finally:
        for name in [*names, empty]:
            _database_factory.drop(name)


def _rows(page: Any) -> list[tuple[str, str]]:
    """(database name, state) of each row of the fleet's table, in order."""
    rows = page.locator("#databases tr.database")
    return [
        (
            rows.nth(i).get_attribute("data-database").rsplit("/", 1)[1],
            rows.nth(i).get_attribute("data-state"),
        )
        for i in range(rows.count())
    ]


def test_the_fleets_page_lists_every_database_unhealthy_first_and_opens_each_ones_console(
    chromium: Any,
    console_server: Callable[..., ConsoleServer],
    four: list[str],
    _database_factory: DatabaseFactory,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    served, fine, parked, empty = four
    engine = sa.create_engine(_database_factory.url_for(parked))
    poison, _ = insert_rows(engine, "orders", [("k1", b"a"), ("k2", b"b")])
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE outbox SET parked_at = now() WHERE key = 'k1'")
    engine.dispose()
    down = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nowhere"
    listing = tmp_path / "databases.txt"
    urls = [_database_factory.url_for(n) for n in (served, fine, parked, empty)]
    listing.write_text("\n".join([*urls, down]) + "\n")
    # A fleet relay serving one of them: its serving session shows on the page.
    relay_listing = tmp_path / "relay-databases.txt"
    relay_listing.write_text(_database_factory.url_for(served) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    relay = subprocess.Popen(
        [sys.executable, "-m", "outbox.cli.relay", "--databases-file", str(relay_listing),
         "--member-id", "a", "--bootstrap-servers", kafka_bootstrap],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    page = chromium.new_context(viewport=VIEWPORT).new_page()
    try:
        server = console_server("--databases-file", str(listing), env={"OUTBOX_DATABASE_URL": ""})

        def served_now() -> bool:
            page.goto(server.url + "/")
            return (served, "ok") in _rows(page)

        wait_for(served_now, 60, "the fleet relay to serve its database")
        # Down, then unmigrated, then the one with a parked row, then the unserved one (by
        # the status's own order); the served, healthy one last.
        assert _rows(page) == [
            ("nowhere", "down"), (empty, "unmigrated"), (parked, "unserved"),
            (fine, "unserved"), (served, "ok"),
        ]  # fmt: skip
        assert page.locator("#database-count").inner_text() == "5"
        assert page.locator("#unhealthy-count").inner_text() == "4"
        owner = page.locator(f'tr[data-database$="/{served}"] td').nth(5).inner_text()
        assert owner.startswith("pid "), owner
        assert page.locator('tr[data-state="down"] .warning').count() == 2  # state, reason
        shoot(page, tmp_path, "fleet")

        # The parked count opens that database's parked events; its nav stays with it.
        page.click(f'tr[data-database$="/{parked}"] a.warning')
        assert "/db/" in page.url and page.url.endswith("/parked")
        assert page.locator(f'tbody.row[data-event-id="{poison}"]').count() == 1
        assert str(parked) in page.locator("footer").inner_text()
        page.click("nav >> text=Overview")
        assert page.url.endswith("/") and "/db/" in page.url
        assert page.locator("#pending").inner_text() == "1"
        assert page.locator("#parked-count").inner_text() == "1"
        page.click("#parked-count a")
        assert page.url.endswith("/parked") and "/db/" in page.url
        page.click("#fleet-link")
        assert page.url == server.url + "/"

        # Another database's console shows its own numbers.
        page.click(f'tr[data-database$="/{fine}"] td a')
        assert page.locator("#pending").inner_text() == "0"
        assert page.locator("#parked-count").inner_text() == "0"
        assert str(fine) in page.locator("footer").inner_text()

        # The unmigrated and the down database: a clear error, not a traceback.
        for name in (empty, "nowhere"):
            page.goto(server.url + "/")
            with page.expect_response(lambda r: "/db/" in r.url) as answer:
                page.click(f'tr[data-database$="/{name}"] td a')
            assert answer.value.status == 503, name
            assert "Traceback" not in page.content()
    finally:
        page.context.close()
        relay.terminate()
        relay.wait(30)
