"""``outbox console`` over TCP (a real uvicorn process, real PostgreSQL), driven with httpx:
pages render, filters narrow, read-only and CSRF refusals, escaping, and bad input as 400;
dead-letter groups marked handled leave the page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from hypothesis import given, settings, strategies as st

from outbox import migrate
from outbox.schema import tables
from tests.fixtures.common import wait_for
from tests.fixtures.console import ADMIN_TOKEN, ConsoleServer, write_dead_letters
from tests.fixtures.relay import insert_rows, outbox_count

BEARER = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def park(engine: sa.Engine, ids: list[uuid.UUID], error: str) -> None:
    """Park rows the way the relay does: parked_at set, the error and attempts kept."""
    t = tables(None).outbox
    with engine.begin() as conn:
        conn.execute(
            sa.update(t)
            .where(t.c.event_id.in_(ids))
            .values(parked_at=sa.func.now(), last_error=error, attempts=3)
        )


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found, "no CSRF field on the page"
    return found.group(1)


@pytest.fixture
def parked(engine: sa.Engine) -> dict[str, list[uuid.UUID]]:
    """Two topics' parked rows with different errors, and a pending row."""
    a = insert_rows(engine, "orders", [("k1", b'{"n": 1}'), ("k2", b"<script>alert(1)</script>")])
    b = insert_rows(engine, "payments", [("p1", b"\x00\xff\x10")], {"token": "x"})
    pending = insert_rows(engine, "orders", [("k9", b"later")])
    park(engine, a, "MSG_SIZE_TOO_LARGE: too big")
    park(engine, b, "UNKNOWN_TOPIC_OR_PART")
    return {"orders": a, "payments": b, "pending": pending}


def test_pages_render_the_backlog_and_the_parked_rows(
    console_server: Callable[..., ConsoleServer], parked: dict[str, list[uuid.UUID]]
) -> None:
    server = console_server()
    with httpx.Client(base_url=server.url) as client:
        overview = client.get("/")
        assert overview.status_code == 200
        assert re.search(r'id="parked-count"><a href="/parked">3<', overview.text)
        assert re.search(r'id="pending">1<', overview.text)
        # The warning sends the operator to the console's own page, not to a CLI command.
        assert 'see <a href="/parked">the Parked page</a>' in overview.text
        assert "`" not in overview.text
        # The table it reads, as its session resolves it (what the relay and status name).
        assert "table public.outbox ·" in overview.text
        page = client.get("/parked")
        assert page.status_code == 200
        for event_id in parked["orders"] + parked["payments"]:
            assert str(event_id) in page.text
        assert str(parked["pending"][0]) not in page.text
        # JSON pretty-printed, binary as hex; read-only: no action buttons.
        assert "{\n  &#34;n&#34;: 1\n}" in page.text
        assert "00 ff 10" in page.text
        assert 'action="/parked/action"' not in page.text
        assert client.get("/keys").status_code == 200


def test_filters_narrow_by_topic_key_and_error_text(
    console_server: Callable[..., ConsoleServer], parked: dict[str, list[uuid.UUID]]
) -> None:
    server = console_server()
    with httpx.Client(base_url=server.url) as client:
        by_topic = client.get("/parked", params={"topic": "payments"}).text
        by_key = client.get("/parked", params={"key": "k2"}).text
        # case-insensitive, and "_" is a literal underscore, not a wildcard
        by_error = client.get("/parked", params={"error": "unknown_topic"}).text
        wildcard = client.get("/parked", params={"error": "MSG%"}).text
    assert str(parked["payments"][0]) in by_topic and str(parked["orders"][0]) not in by_topic
    assert str(parked["orders"][1]) in by_key and str(parked["orders"][0]) not in by_key
    assert str(parked["payments"][0]) in by_error and str(parked["orders"][0]) not in by_error
    assert "<strong>0</strong>" in wildcard


def test_an_event_value_holding_script_shows_as_text(
    console_server: Callable[..., ConsoleServer], parked: dict[str, list[uuid.UUID]]
) -> None:
    server = console_server()
    page = httpx.get(f"{server.url}/parked", params={"key": "k2"}).text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<script>" not in page


def test_read_only_console_refuses_changes(
    console_server: Callable[..., ConsoleServer],
    parked: dict[str, list[uuid.UUID]],
    engine: sa.Engine,
) -> None:
    server = console_server()
    form = {"action": "discard", "scope": "matching", "confirmed": "3", "csrf": "x"}
    refused = httpx.post(f"{server.url}/parked/action", data=form, headers=BEARER)
    assert refused.status_code == 403 and "read-only" in refused.text
    assert outbox_count(engine, parked=True) == 3


def test_changes_need_the_token_and_the_csrf_token(
    console_server: Callable[..., ConsoleServer],
    parked: dict[str, list[uuid.UUID]],
    engine: sa.Engine,
) -> None:
    server = console_server("--admin-token", ADMIN_TOKEN)
    with httpx.Client(base_url=server.url, headers=BEARER) as admin:
        page = admin.get("/parked")
        assert 'action="/parked/action"' in page.text
        token = csrf_of(page.text)
        form = {"action": "discard", "scope": "matching", "confirmed": "3"}
        # no token: anonymous visitors read, and are refused changes
        anonymous = httpx.post(
            f"{server.url}/parked/action", data={**form, "csrf": token}, cookies=admin.cookies
        )
        assert anonymous.status_code == 403
        assert 'action="/parked/action"' not in httpx.get(f"{server.url}/parked").text
        # the admin, but the form's CSRF token is missing or does not match the cookie
        assert admin.post("/parked/action", data=form).status_code == 403
        assert admin.post("/parked/action", data={**form, "csrf": "x" * 43}).status_code == 403
        assert outbox_count(engine, parked=True) == 3
        # the admin with the CSRF token: first a confirmation stating the count, then the change
        confirm = admin.post("/parked/action", data={**form, "confirmed": "", "csrf": token})
        assert confirm.status_code == 200
        assert re.search(r'id="confirm-count">3<', confirm.text)
        assert outbox_count(engine, parked=True) == 3
        done = admin.post("/parked/action", data={**form, "csrf": token})
        assert done.status_code == 303
    assert outbox_count(engine, parked=True) == 0
    assert outbox_count(engine) == 1
    assert "admin discard: 3 parked row(s)" in server.log()
    assert "from 127.0.0.1" in server.log()


def test_a_stale_confirmation_is_asked_again_with_the_new_count(
    console_server: Callable[..., ConsoleServer],
    parked: dict[str, list[uuid.UUID]],
    engine: sa.Engine,
) -> None:
    server = console_server("--admin-token", ADMIN_TOKEN)
    with httpx.Client(base_url=server.url, headers=BEARER) as admin:
        token = csrf_of(admin.get("/parked").text)
        form = {"action": "retry", "scope": "matching", "topic": "orders", "csrf": token}
        again = admin.post("/parked/action", data={**form, "confirmed": "5"})
    assert again.status_code == 200 and re.search(r'id="confirm-count">2<', again.text)
    assert outbox_count(engine, parked=True) == 3


def test_retry_of_a_selection_touches_only_those_rows(
    console_server: Callable[..., ConsoleServer],
    parked: dict[str, list[uuid.UUID]],
    engine: sa.Engine,
) -> None:
    server = console_server("--admin-token", ADMIN_TOKEN)
    chosen = parked["orders"][0]
    with httpx.Client(base_url=server.url, headers=BEARER) as admin:
        token = csrf_of(admin.get("/parked").text)
        form = {"action": "retry", "scope": "selected", "event_id": str(chosen), "csrf": token}
        assert admin.post("/parked/action", data={**form, "confirmed": "1"}).status_code == 303
    t = tables(None).outbox
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(t.c.parked_at, t.c.attempts).where(t.c.event_id == chosen)
        ).one()
    assert row.parked_at is None and row.attempts == 0
    assert outbox_count(engine, parked=True) == 2


@pytest.mark.parametrize(
    ("method", "path", "data"),
    [
        ("GET", "/parked?topic=not%20a%20topic", None),
        ("GET", "/parked?offset=-1", None),
        ("GET", "/parked?offset=ten", None),
        ("GET", "/keys?scope=bad%20scope&key=k", None),
        ("GET", "/keys?scope=orders", None),
        ("POST", "/parked/action", {"action": "retry", "scope": "selected", "event_id": "nope"}),
        ("POST", "/parked/action", {"action": "explode", "scope": "matching"}),
        ("POST", "/parked/action", {"action": "retry", "scope": "selected"}),
    ],
)
def test_bad_filters_and_ids_are_400_with_a_message(
    console_server: Callable[..., ConsoleServer],
    parked: dict[str, list[uuid.UUID]],
    method: str,
    path: str,
    data: dict[str, Any] | None,
) -> None:
    server = console_server("--admin-token", ADMIN_TOKEN)
    with httpx.Client(base_url=server.url, headers=BEARER) as admin:
        token = csrf_of(admin.get("/parked").text) if data is not None else ""
        if data is not None:
            data = {**data, "csrf": token}
        answer = admin.request(method, path, data=data)
    assert answer.status_code == 400, answer.text
    assert 'id="error-message"' in answer.text and "Traceback" not in answer.text


def test_no_secret_on_any_page(
    console_server: Callable[..., ConsoleServer], database_url: str
) -> None:
    secret_url = database_url.replace("postgres@", "postgres:s3cr3t-pw@", 1)
    server = ConsoleServer(secret_url, "--redis-url", "redis://:r3dis-pw@127.0.0.1:6379/0")
    try:
        server.start()
        with httpx.Client(base_url=server.url) as client:
            pages = [client.get(p).text for p in ("/", "/parked", "/keys", "/parked?offset=x")]
    finally:
        server.stop()
        server.close()
    for text in pages:
        assert "s3cr3t-pw" not in text and "r3dis-pw" not in text
    assert "***" in pages[0]


def test_basic_auth_with_the_token_as_password_signs_in(
    console_server: Callable[..., ConsoleServer], parked: dict[str, list[uuid.UUID]]
) -> None:
    server = console_server("--admin-token", ADMIN_TOKEN)
    challenge = httpx.get(f"{server.url}/login")
    assert challenge.status_code == 401
    assert challenge.headers["www-authenticate"].startswith("Basic ")
    wrong = httpx.get(f"{server.url}/parked", auth=("oncall", ADMIN_TOKEN + "x")).text
    assert 'action="/parked/action"' not in wrong
    with httpx.Client(base_url=server.url, auth=("oncall", ADMIN_TOKEN)) as admin:
        assert admin.get("/login").status_code == 303
        assert 'action="/parked/action"' in admin.get("/parked").text


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        ([], {}, "OUTBOX_DATABASE_URL"),
        (["--port", "0"], {}, "--port"),
        ([], {"OUTBOX_CONSOLE_PORT": "http"}, "OUTBOX_CONSOLE_PORT"),
        (["--host", "0.0.0.0/8"], {}, "--host"),
        ([], {"OUTBOX_CONSOLE_ADMIN_TOKEN": "short-secret"}, "at least 16"),
        (["--count-budget", "-1"], {}, "--count-budget must be positive"),
        ([], {"OUTBOX_CONSOLE_COUNT_BUDGET": "61"}, "at most 60"),
    ],
)
def test_bad_console_settings_exit_2_with_one_line_before_serving(
    database_url: str, args: list[str], env: dict[str, str], says: str
) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    if args or env:
        environ["OUTBOX_DATABASE_URL"] = database_url
    done = subprocess.run(
        [sys.executable, "-m", "outbox.cli", "console", *args],
        capture_output=True, text=True, env={**environ, **env}, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "short-secret" not in done.stderr


FILTER_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)


def test_hostile_filters_are_a_page_or_a_400_never_a_500(
    console_server: Callable[..., ConsoleServer],
    parked: dict[str, list[uuid.UUID]],
    engine: sa.Engine,
) -> None:
    server = console_server("--admin-token", ADMIN_TOKEN)
    with httpx.Client(base_url=server.url, headers=BEARER) as client:
        token = csrf_of(client.get("/parked").text)

        @settings(max_examples=40, deadline=None)
        @given(
            name=st.sampled_from(["topic", "key", "error", "offset", "scope", "event_id"]),
            value=FILTER_TEXT,
            where=st.sampled_from(["/parked", "/keys", "/parked/action"]),
        )
        def probe(name: str, value: str, where: str) -> None:
            if where == "/parked/action":
                form = {"csrf": token, "action": "retry", "scope": "selected", name: value}
                answer = client.post(where, data=form)
            else:
                answer = client.get(where, params={name: value, "scope": "orders"})
            assert answer.status_code in (200, 400), (answer.status_code, answer.text[-300:])
            assert "Traceback" not in answer.text

        probe()
    assert outbox_count(engine, parked=True) == 3  # no confirmation, nothing changed


def test_a_crafted_outcome_in_a_link_is_not_shown(
    console_server: Callable[..., ConsoleServer],
) -> None:
    server = console_server()
    crafted = httpx.get(f"{server.url}/parked", params={"done": "Call +1 555 0100 now"}).text
    assert "555 0100" not in crafted
    genuine = httpx.get(f"{server.url}/parked", params={"done": "3 row(s) discarded"}).text
    assert 'id="done">3 row(s) discarded<' in genuine


def test_missing_tables_are_a_503_with_a_message_not_a_traceback(
    console_server: Callable[..., ConsoleServer], database_url: str
) -> None:
    server = console_server()
    migrate.downgrade(database_url, "base")
    for path in ("/", "/parked", "/keys?scope=orders&key=k1"):
        answer = httpx.get(server.url + path)
        assert answer.status_code == 503, (path, answer.status_code)
        assert 'id="error-message"' in answer.text and "Traceback" not in answer.text


def test_the_overview_charts_rows_relayed_since_the_console_started(
    console_server: Callable[..., ConsoleServer], engine: sa.Engine
) -> None:
    server = console_server()
    assert "(0 in all" in httpx.get(server.url + "/").text
    insert_rows(engine, "orders", [(f"k{i}", b"v") for i in range(7)])
    with engine.begin() as conn:  # what a relay does with rows Kafka confirmed
        conn.execute(sa.delete(tables(None).outbox))

    def charted() -> bool:
        return "(7 in all" in httpx.get(server.url + "/").text

    wait_for(charted, 30, "the deletes never reached the chart")
    page = httpx.get(server.url + "/").text
    assert '<svg id="relayed-chart"' in page and "<rect " in page


def test_a_count_made_in_the_background_says_when_and_parked_rows_stay_exact(
    console_server: Callable[..., ConsoleServer], engine: sa.Engine
) -> None:
    """With a count budget of 0 (every backlog counts as big), the first overview counts in
    its snapshot and says every count is exact; later ones show that count labeled with its
    time while the parked numbers are counted for the page, until a background count (due
    after 5 s) brings the pending numbers up to date."""
    server = console_server("--count-budget", "0")
    insert_rows(engine, "orders", [("k1", b"1"), ("k2", b"2")])
    first = httpx.get(server.url + "/").text
    assert re.search(r'id="pending">2<', first)
    assert 'id="counted">Every count is exact' in first
    assert "pending-counted-at" not in first
    later = insert_rows(engine, "orders", [("k3", b"3"), ("k4", b"4"), ("k5", b"5")])
    park(engine, later[:1], "MSG_SIZE_TOO_LARGE")
    page = httpx.get(server.url + "/").text
    counted = re.search(r'id="pending-counted-at">counted at (\d\d:\d\d:\d\d) ', page)
    assert counted, "the pending count is not labeled with the time it was made"
    assert "Parked rows: exact, counted for this page" in page
    assert re.search(r'id="pending">2<', page)  # as counted, not as it is now (4)
    assert re.search(r'id="parked-count"><a href="/parked">1<', page)  # as it is now
    assert f"pending at {counted.group(1)}</th>" in page
    assert re.search(r'<td>orders</td><td class="num">2</td>\s*<td class="num"><a href', page)

    def recounted() -> bool:
        return re.search(r'id="pending">4<', httpx.get(server.url + "/").text) is not None

    wait_for(recounted, 30, "no background count reached the page")


# -- dead letters marked handled -------------------------------------------------------------


def handled_count(engine: sa.Engine) -> int:
    t = tables(None).dlq_handled
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one())


@pytest.fixture
def dead_topic(kafka_bootstrap: str) -> str:
    return write_dead_letters(
        kafka_bootstrap,
        f"billing-{uuid.uuid4().hex[:8]}",
        [
            ("inv-1", KeyError("'inv-1' has no customer")),
            ("inv-2", KeyError("'inv-2' has no customer")),
            ("inv-3", ValueError("price -3 is negative")),
            ("inv-4", TypeError("no price")),
        ],
    )


def group_ids(page: str) -> list[str]:
    return re.findall(r'<tbody class="group" data-group="([0-9a-f]{12})">', page)


def test_a_group_and_a_selection_are_marked_handled_after_a_confirmation(
    console_server: Callable[..., ConsoleServer],
    kafka_bootstrap: str,
    dead_topic: str,
    engine: sa.Engine,
) -> None:
    server = console_server("--admin-token", ADMIN_TOKEN, "--bootstrap-servers", kafka_bootstrap)
    with httpx.Client(base_url=server.url, headers=BEARER) as client:
        page = client.get("/dlq", params={"topic": dead_topic}).text
        assert 'action="/dlq/handled"' in page and 'id="handled-selected"' in page
        biggest, *others = group_ids(page)
        form = {"csrf": csrf_of(page), "topic": dead_topic, "group": biggest}
        confirm = client.post("/dlq/handled", data=form)
        assert confirm.status_code == 200 and re.search(r'id="confirm-count">2<', confirm.text)
        assert handled_count(engine) == 0  # nothing changes before the confirmation
        done = client.post("/dlq/handled", data={**form, "confirmed": "2"})
        assert done.status_code == 303 and "marked+handled" in done.headers["location"]
        page = client.get(done.headers["location"]).text
        assert 'id="done">2 dead letter(s) marked handled<' in page
        assert set(group_ids(page)) == set(others)
        assert re.search(r'id="dlq-handled">2<', page)
        # the ticked groups, together
        ticked = {"csrf": csrf_of(page), "topic": dead_topic, "group": others}
        confirm = client.post("/dlq/handled", data=ticked)
        assert re.search(r'id="confirm-count">2<', confirm.text)
        assert client.post("/dlq/handled", data={**ticked, "confirmed": "2"}).status_code == 303
        page = client.get("/dlq", params={"topic": dead_topic}).text
        assert group_ids(page) == [] and re.search(r'id="dlq-handled">4<', page)
    assert handled_count(engine) == 4
    assert f"admin mark handled: 2 dead letter(s) of {dead_topic} (groups {biggest})" in (
        server.log()
    )


def test_a_redrive_from_the_console_marks_the_group_redriven(
    console_server: Callable[..., ConsoleServer],
    kafka_bootstrap: str,
    dead_topic: str,
    engine: sa.Engine,
) -> None:
    server = console_server("--admin-token", ADMIN_TOKEN, "--bootstrap-servers", kafka_bootstrap)
    with httpx.Client(base_url=server.url, headers=BEARER) as client:
        page = client.get("/dlq", params={"topic": dead_topic}).text
        biggest = group_ids(page)[0]
        form = {"csrf": csrf_of(page), "topic": dead_topic, "group": biggest, "confirmed": "2"}
        assert client.post("/dlq/redrive", data=form).status_code == 303
        page = client.get("/dlq", params={"topic": dead_topic}).text
    assert biggest not in group_ids(page)
    t = tables(None).dlq_handled
    with engine.connect() as conn:
        hows = conn.execute(sa.select(t.c.how, t.c.handled_by)).all()
    assert [tuple(r) for r in hows] == [("redriven", "outbox console from 127.0.0.1")] * 2


def test_marking_handled_is_refused_read_only_without_csrf_and_with_bad_ids(
    console_server: Callable[..., ConsoleServer],
    kafka_bootstrap: str,
    dead_topic: str,
    engine: sa.Engine,
) -> None:
    read_only = console_server("--bootstrap-servers", kafka_bootstrap)
    form = {"csrf": "x", "topic": dead_topic, "group": "0123456789ab", "confirmed": "2"}
    refused = httpx.post(f"{read_only.url}/dlq/handled", data=form, headers=BEARER)
    assert refused.status_code == 403 and "read-only" in refused.text
    assert (
        'action="/dlq/handled"'
        not in httpx.get(f"{read_only.url}/dlq", params={"topic": dead_topic}).text
    )
    server = console_server("--admin-token", ADMIN_TOKEN, "--bootstrap-servers", kafka_bootstrap)
    with httpx.Client(base_url=server.url, headers=BEARER) as client:
        page = client.get("/dlq", params={"topic": dead_topic}).text
        assert client.post("/dlq/handled", data=form).status_code == 403  # a stale CSRF token
        token = csrf_of(page)
        none = client.post("/dlq/handled", data={"csrf": token, "topic": dead_topic})
        assert none.status_code == 400 and "no group chosen" in none.text

        @settings(max_examples=40, deadline=None)
        @given(
            groups=st.lists(st.text(max_size=20), min_size=1, max_size=3).filter(
                lambda gs: any(not re.fullmatch(r"[0-9a-f]{12}", g) for g in gs)
            ),
            real=st.booleans(),
        )
        def probe(groups: list[str], real: bool) -> None:
            chosen = [*groups, *group_ids(page)[:1]] if real else groups
            bad = {"csrf": token, "topic": dead_topic, "group": chosen, "confirmed": "2"}
            answer = client.post("/dlq/handled", data=bad)
            assert answer.status_code == 400, (answer.status_code, answer.text[-300:])
            assert "is not a group id" in answer.text and "Traceback" not in answer.text

        probe()
    assert handled_count(engine) == 0


def test_a_planted_csrf_cookie_with_a_matching_form_token_of_its_own_is_refused(
    console_server: Callable[..., ConsoleServer],
    parked: dict[str, list[uuid.UUID]],
    engine: sa.Engine,
) -> None:
    # A sibling subdomain (same-site) can set the console's cookie to a value it chose and post
    # a form carrying the same value; the browser adds the admin's cached credentials.
    server = console_server("--admin-token", ADMIN_TOKEN)
    planted = "A" * 43
    form = {"action": "discard", "scope": "matching", "confirmed": "3", "csrf": planted}
    # The token another browser's page carries belongs to that browser's cookie.
    other = csrf_of(httpx.get(f"{server.url}/parked", headers=BEARER).text)
    with httpx.Client(base_url=server.url, headers=BEARER) as client:
        client.cookies.set("outbox_console_csrf", planted)
        refused = client.post("/parked/action", data=form)
        assert refused.status_code == 403 and "CSRF token" in refused.text
        assert client.post("/parked/action", data={**form, "csrf": other}).status_code == 403
    assert outbox_count(engine, parked=True) == 3


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "https://evil.example"},
        {"Origin": "null"},
        {"Origin": "null", "Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
        {"Sec-Fetch-Site": "cross-site"},
    ],
    ids=[
        "foreign-origin",
        "opaque-origin",
        "opaque-cross-site",
        "same-site-fetch",
        "cross-site-fetch",
    ],
)
def test_a_change_from_another_origin_is_refused_even_with_a_valid_csrf_token(
    console_server: Callable[..., ConsoleServer],
    parked: dict[str, list[uuid.UUID]],
    engine: sa.Engine,
    headers: dict[str, str],
) -> None:
    server = console_server("--admin-token", ADMIN_TOKEN)
    with httpx.Client(base_url=server.url, headers=BEARER) as admin:
        token = csrf_of(admin.get("/parked").text)
        form = {"action": "discard", "scope": "matching", "confirmed": "3", "csrf": token}
        refused = admin.post("/parked/action", data=form, headers=headers)
        assert refused.status_code == 403 and "another site" in refused.text
        assert outbox_count(engine, parked=True) == 3
        # The same form from the console's own origin goes through.
        own = {"Origin": server.url, "Sec-Fetch-Site": "same-origin"}
        done = admin.post("/parked/action", data=form, headers=own)
    assert done.status_code == 303
    assert outbox_count(engine, parked=True) == 0
