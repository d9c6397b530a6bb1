"""The admin pages of ``outbox.django`` in-process (Django's test client on the test's real
PostgreSQL): read-only for a user with the view permission, retry and discard of parked rows
only with ``outbox.retry_parked`` / ``outbox.discard_parked``, through outbox.admin."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from outbox import admin
from tests.django.admin_rows import park, parked_at

PARKED = "/admin/outbox/parkedevent/"


def client(user: Any) -> Any:
    from django.test import Client

    c = Client()
    c.force_login(user)
    return c


def act(user: Any, action: str, *event_ids: Any, engine: sa.Engine) -> Any:
    """POST an admin action on the parked rows of ``event_ids`` (by their ``id``)."""
    with engine.connect() as conn:
        ids = [str(r.id) for r in admin.list_parked(conn) if r.event_id in event_ids]
    return client(user).post(PARKED, {"action": action, "_selected_action": ids})


def test_the_view_permission_shows_parked_rows_without_an_action(
    users: dict[str, Any], engine: sa.Engine
) -> None:
    (event_id,) = park(engine, "django.poison", "k1")
    page = client(users["viewer"]).get(PARKED)
    assert page.status_code == 200
    text = page.content.decode()
    assert str(event_id) in text and "MSG_SIZE_TOO_LARGE" in text and "k1" in text
    assert 'value="retry"' not in text and 'value="discard"' not in text
    found = client(users["viewer"]).get(PARKED, {"q": str(event_id)[:8]}).content.decode()
    assert str(event_id) in found
    act(users["viewer"], "retry", event_id, engine=engine)
    act(users["viewer"], "discard", event_id, engine=engine)
    assert parked_at(engine, event_id) is not None  # still parked, still there


def test_retry_parked_retries_and_does_not_discard(
    users: dict[str, Any], engine: sa.Engine
) -> None:
    first, second = park(engine, "django.poison", "k1", "k2")
    text = client(users["retrier"]).get(PARKED).content.decode()
    assert 'value="retry"' in text and 'value="discard"' not in text
    act(users["retrier"], "discard", first, engine=engine)
    assert parked_at(engine, first) is not None
    act(users["retrier"], "retry", first, engine=engine)
    assert parked_at(engine, first) is None  # back in line
    assert parked_at(engine, second) is not None  # only the chosen row
    with engine.connect() as conn:
        assert [r.event_id for r in admin.list_parked(conn)] == [second]


def test_a_superuser_discards_a_parked_row(users: dict[str, Any], engine: sa.Engine) -> None:
    (event_id,) = park(engine, "django.poison", "k1")
    text = client(users["root"]).get(PARKED).content.decode()
    assert 'value="retry"' in text and 'value="discard"' in text
    act(users["root"], "discard", event_id, engine=engine)
    with pytest.raises(sa.exc.NoResultFound):
        parked_at(engine, event_id)


def test_keys_and_handled_dead_letters_are_read_only_lists(
    users: dict[str, Any], engine: sa.Engine
) -> None:
    from outbox.django import unit_of_work

    with unit_of_work("order-7"):
        pass
    with engine.begin() as conn:
        admin.mark_handled(conn, "orders.dlq", [(0, 3)], "discarded", by="cli alice")
    viewer = client(users["viewer"])
    keys = viewer.get("/admin/outbox/idempotencykey/")
    assert keys.status_code == 200 and "order-7" in keys.content.decode()
    handled = viewer.get("/admin/outbox/handleddeadletter/").content.decode()
    assert "orders.dlq" in handled and "cli alice" in handled
    for page in ("idempotencykey/order-7/change/", "idempotencykey/add/", "parkedevent/add/",
                 "handleddeadletter/3/delete/"):  # fmt: skip
        assert viewer.get("/admin/outbox/" + page).status_code in (302, 403, 404), page
    assert client(users["retrier"]).get("/admin/outbox/idempotencykey/").status_code == 403
