"""``outbox console`` in a real browser (Debian's Chromium under Playwright) against a real
console process, PostgreSQL, relay and broker: a poison event is parked, found on the page,
retried from it and delivered; dead letters redriven and marked handled; a key lookup; read-only
mode; escaping in the browser.

A screenshot of each page lands in the test's tmp dir; with OUTBOX_CONSOLE_SCREENSHOTS=DIR they
are also written to DIR (how docs/console/ is made).
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from outbox import Outbox
from outbox.schema import tables
from tests.fixtures.console import ADMIN_TOKEN, ConsoleServer, write_dead_letters
from tests.fixtures.kafka import read_to_end
from tests.fixtures.relay import (
    REPO,
    insert_rows,
    outbox_count,
    relay_command,
    wait_for_records,
)

VIEWPORT = {"width": 1100, "height": 700}


def shoot(page: Any, tmp_path: Path, name: str) -> None:
    page.screenshot(path=str(tmp_path / f"{name}.png"))
    target = os.environ.get("OUTBOX_CONSOLE_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(target) / f"{name}.png"))


def relay_once(database_url: str, bootstrap: str, *args: str) -> None:
    done = subprocess.run(
        relay_command(database_url, bootstrap, "--once", *args),
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def admin_page(chromium: Any) -> Any:
    # What a proxy in front of the console, or the browser after "sign in as admin", sends.
    context = chromium.new_context(
        viewport=VIEWPORT, extra_http_headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    return context.new_page()


def test_a_parked_event_is_retried_from_the_page_and_delivered(
    chromium: Any,
    console_server: Callable[..., ConsoleServer],
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    topic = f"console-{uuid.uuid4().hex[:8]}"
    big = b'{"order": 7, "note": "' + b"x" * 5000 + b'"}'
    poison, healthy = insert_rows(
        engine, topic, [("order-7", big), ("o-8", b"ok")], {"source": "checkout"}
    )
    # The broker refuses the big record at this size limit: the relay parks it.
    relay_once(database_url, kafka_bootstrap, "--kafka-config", "message.max.bytes=2000")
    assert outbox_count(engine, parked=True) == 1
    # A backlog waiting on another topic, so the overview (docs/console/overview.png) shows
    # what an operator sees on a working day rather than an empty outbox.
    waiting = insert_rows(engine, f"{topic}-payments", [(f"pay-{i}", b"{}") for i in range(12)])
    server = console_server("--admin-token", ADMIN_TOKEN)
    page = admin_page(chromium)
    try:
        page.goto(server.url + "/")
        assert page.locator("#parked-count").inner_text() == "1"
        assert page.locator("#pending").inner_text() == "12"
        shoot(page, tmp_path, "overview")
        page.click("#parked-count a")
        row = page.locator(f'tbody.row[data-event-id="{poison}"]')
        assert row.count() == 1
        assert "MSG_SIZE_TOO_LARGE" in row.inner_text()
        row.locator("summary").click()
        assert "checkout" in row.locator("table.headers").inner_text()
        shoot(page, tmp_path, "parked")
        row.locator('input[type="checkbox"]').check()
        page.click("#retry-selected")
        assert page.locator("#confirm-count").inner_text() == "1"
        shoot(page, tmp_path, "confirm")
        assert outbox_count(engine, parked=True) == 1  # nothing changes before the confirmation
        page.click("#confirm")
        assert page.locator("#done").inner_text() == "1 row(s) put back in line"
        assert page.locator(f'tbody.row[data-event-id="{poison}"]').count() == 0
    finally:
        page.context.close()
    assert outbox_count(engine, parked=True) == 0
    relay_once(database_url, kafka_bootstrap)
    wait_for_records(kafka_bootstrap, topic, [poison, healthy])
    wait_for_records(kafka_bootstrap, f"{topic}-payments", waiting)
    assert outbox_count(engine) == 0


def test_a_dead_letter_group_is_redriven_and_another_marked_handled_from_the_page(
    chromium: Any,
    console_server: Callable[..., ConsoleServer],
    engine: sa.Engine,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    topic = f"billing-{uuid.uuid4().hex[:8]}"
    dead = write_dead_letters(
        kafka_bootstrap,
        topic,
        [
            ("inv-1", KeyError("'inv-1' has no customer")),
            ("inv-2", KeyError("'inv-2' has no customer")),
            ("inv-3", ValueError("<script>alert(3)</script> is not a price")),
        ],
    )
    server = console_server("--admin-token", ADMIN_TOKEN, "--bootstrap-servers", kafka_bootstrap)
    page = admin_page(chromium)
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    try:
        # With a broker, the overview has the consumer groups' lag section: a table or a line.
        page.goto(server.url + "/")
        assert page.locator("#consumer-lag").is_visible()
        assert page.locator("#consumer-lag").locator("#lags, #lag-unavailable, p.empty").count()
        page.goto(server.url + "/dlq")
        page.fill('input[name="topic"]', dead)
        page.click('#dlq-topic button[type="submit"]')
        groups = page.locator("tbody.group")
        assert groups.count() == 2
        first = groups.nth(0)
        assert "'inv-<n>' has no customer" in first.inner_text()
        assert first.locator("td.num").first.inner_text() == "2"
        groups.nth(1).locator("summary").click()
        assert "<script>alert(3)</script>" in groups.nth(1).inner_text()
        shoot(page, tmp_path, "dead-letters")
        first.locator("button.redrive").click()
        assert page.locator("#confirm-count").inner_text() == "2"
        page.click("#confirm")
        assert page.locator("#done").inner_text() == "2 dead letter(s) redriven"
        # The redriven group left the page; the other one is marked handled from its button.
        assert page.locator("tbody.group").count() == 1
        assert page.locator("#dlq-handled").inner_text() == "2"
        page.locator("tbody.group").first.locator("button.handled").click()
        assert page.locator("#confirm-count").inner_text() == "1"
        page.click("#confirm")
        assert page.locator("#done").inner_text() == "1 dead letter(s) marked handled"
        assert page.locator("tbody.group").count() == 0
        assert page.locator("#dlq-handled").inner_text() == "3"
    finally:
        page.context.close()
    assert dialogs == []
    records = read_to_end(kafka_bootstrap, topic, at_least=2)
    assert sorted(r.key() for r in records) == [b"inv-1", b"inv-2"]
    assert all(dict(r.headers())["outbox.redrive-count"] == b"1" for r in records)
    assert "admin redrive: 2 dead letter(s)" in server.log()
    assert "admin mark handled: 1 dead letter(s)" in server.log()
    t = tables(None).dlq_handled
    with engine.connect() as conn:
        hows = sorted(conn.execute(sa.select(t.c.how)).scalars())
    assert hows == ["discarded", "redriven", "redriven"]


def test_a_key_lookup_shows_a_completed_and_a_failed_key(
    chromium: Any,
    console_server: Callable[..., ConsoleServer],
    engine: sa.Engine,
    tmp_path: Path,
) -> None:
    keys = tables(None).idempotency_keys
    with engine.begin() as conn:
        conn.execute(
            sa.insert(keys),
            [
                {"scope": "checkout", "key": "req-2", "status": "failed",
                 "fingerprint": "f2", "result": None, "error": "CardDeclined: insufficient funds"},
            ],
        )  # fmt: skip
    # A request's unit of work: its result and two events, keyed by order and by customer.
    outbox = Outbox(engine)
    with outbox.unit_of_work("req-1", scope="checkout") as uow:
        uow.publish("orders", {"order_id": 41}, key="order-41")
        uow.publish("emails", {"to": "ada@example.com"}, key="customer-7")
        uow.result = {"order_id": 41}
    outbox.close()
    server = console_server()
    page = chromium.new_page(viewport=VIEWPORT)
    try:
        page.goto(server.url + "/keys")
        page.fill('input[name="scope"]', "checkout")
        page.fill('input[name="key"]', "req-1")
        page.click('#lookup button[type="submit"]')
        assert page.locator("#key-status").inner_text() == "completed"
        assert '"order_id": 41' in page.locator("#key-result").inner_text()
        assert page.locator("#key-events tbody tr").count() == 2
        shoot(page, tmp_path, "keys")
        page.fill('input[name="key"]', "req-2")
        page.click('#lookup button[type="submit"]')
        assert page.locator("#key-status").inner_text() == "failed"
        assert page.locator("#key-error").inner_text() == "CardDeclined: insufficient funds"
    finally:
        page.close()


def test_read_only_mode_shows_no_actions_refuses_changes_and_runs_no_value(
    chromium: Any,
    console_server: Callable[..., ConsoleServer],
    engine: sa.Engine,
    tmp_path: Path,
) -> None:
    hostile = b"<script>alert(1)</script><img src=x onerror=alert(2)>"
    ids = insert_rows(engine, "orders", [("evil", hostile)])
    t = tables(None).outbox
    with engine.begin() as conn:
        conn.execute(sa.update(t).values(parked_at=sa.func.now(), last_error="<b>bold</b>"))
    server = console_server()
    page = chromium.new_page(viewport=VIEWPORT)
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    try:
        page.goto(server.url + "/parked")
        row = page.locator(f'tbody.row[data-event-id="{ids[0]}"]')
        row.locator("summary").click()
        assert row.locator("pre.value").inner_text() == hostile.decode()
        assert "<b>bold</b>" in row.inner_text()
        assert page.locator("button").count() == 1  # the filter's, no action buttons
        assert page.locator("#retry-matching, #retry-selected").count() == 0
        shoot(page, tmp_path, "read-only")
        refused = page.request.post(
            server.url + "/parked/action",
            form={"action": "discard", "scope": "matching", "confirmed": "1"},
        )
        assert refused.status == 403
    finally:
        page.close()
    assert dialogs == []
    assert outbox_count(engine, parked=True) == 1
