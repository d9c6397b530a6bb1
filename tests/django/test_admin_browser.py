"""The admin pages in a real browser (Debian's Chromium under Playwright) against the test
project under ``manage.py runserver`` over TCP: a superuser signs in, finds a parked row and
retries it; a staff user with only the view permission sees the row and no action."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from tests.django.admin_rows import park, parked_at
from tests.django.test_middleware_server import Site
from tests.fixtures.console import chromium as chromium


@pytest.fixture(autouse=True)
def _django_beside_playwright(monkeypatch: pytest.MonkeyPatch) -> None:
    # Playwright's sync API keeps an event loop in this thread, which Django takes for an async
    # context; the in-process Django only sets up users and rows here, between browser calls.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")


@pytest.fixture
def admin_site(
    users: dict[str, Any], django_database: str, redis_url: str, redis_prefix: str
) -> Iterator[Site]:
    running = Site(django_database, redis_url, redis_prefix)
    running.start()
    try:
        yield running
    finally:
        running.close()


def signed_in(chromium: Any, site: Site, name: str) -> Any:
    assert site.server is not None
    page = chromium.new_context().new_page()
    page.goto(site.server.url + "/admin/login/?next=/admin/outbox/parkedevent/")
    page.fill("#id_username", name)
    page.fill("#id_password", "pw")
    page.click("input[type=submit]")
    page.wait_for_url("**/admin/outbox/parkedevent/")
    return page


def test_a_superuser_retries_a_parked_row_from_the_admin(
    chromium: Any, admin_site: Site, engine: sa.Engine
) -> None:
    first, second = park(engine, "django.poison", "order-1", "order-2")
    page = signed_in(chromium, admin_site, "root")
    row = page.locator("#result_list tbody tr", has_text=str(first))
    assert "MSG_SIZE_TOO_LARGE" in row.inner_text()
    row.locator("input.action-select").check()
    page.select_option("select[name=action]", "retry")
    page.click("button[name=index]")
    page.wait_for_selector("text=1 parked row(s) retried")
    assert parked_at(engine, first) is None
    assert parked_at(engine, second) is not None
    assert str(first) not in page.locator("#result_list").inner_text()


def test_a_staff_user_without_the_permission_sees_parked_rows_read_only(
    chromium: Any, admin_site: Site, engine: sa.Engine
) -> None:
    (event_id,) = park(engine, "django.poison", "order-1")
    page = signed_in(chromium, admin_site, "viewer")
    assert str(event_id) in page.locator("#result_list").inner_text()
    assert page.locator("select[name=action]").count() == 0
    assert page.locator("input.action-select").count() == 0
    assert parked_at(engine, event_id) is not None
