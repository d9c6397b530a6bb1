"""Django configured on the suite's per-test PostgreSQL database and Redis (no mocks)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

django = pytest.importorskip("django")

from django.conf import settings  # noqa: E402


def _configure() -> None:
    if settings.configured:
        return
    from tests.django.project import common as project

    settings.configure(
        INSTALLED_APPS=project.INSTALLED_APPS,
        MIDDLEWARE=project.MIDDLEWARE,
        TEMPLATES=project.TEMPLATES,
        ROOT_URLCONF="tests.django.project.urls",
        SECRET_KEY="tests-only",
        ALLOWED_HOSTS=["testserver"],
        DATABASES={"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "postgres"}},
        USE_TZ=True,
        OUTBOX={},
    )
    django.setup()


_configure()


@pytest.fixture
def django_database(
    request: pytest.FixtureRequest, database_url: str, redis_url: str, redis_prefix: str
) -> Iterator[str]:
    """Django's ``default`` alias on this test's database, with the shop's table and the
    toolkit's Redis fast path; yields the database URL. (With pytest-django installed, its
    blocker is lifted: the database is the suite's, not one pytest-django creates.)"""
    from django.db import connections

    unblock = contextlib.nullcontext()
    if request.config.pluginmanager.hasplugin("django"):
        unblock = request.getfixturevalue("django_db_blocker").unblock()
    with unblock:
        yield from _on(database_url, redis_url, redis_prefix, connections)


def _on(database_url: str, redis_url: str, redis_prefix: str, connections: Any) -> Iterator[str]:
    from outbox.django import _settings

    url = sa.make_url(database_url)
    connection = connections["default"]
    connection.close()
    connection.settings_dict.update(
        NAME=url.database, USER=url.username or "", PASSWORD=url.password or "",
        HOST=url.host or "", PORT=str(url.port or ""),
    )  # fmt: skip
    settings.OUTBOX = {"REDIS_URL": redis_url, "CACHE_PREFIX": redis_prefix}
    from tests.django.shop.models import Order

    with connection.schema_editor() as editor:
        editor.create_model(Order)
    try:
        yield database_url
    finally:
        connection.close()
        _settings.reset()


def count(engine: Any, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())


@pytest.fixture
def users(django_database: str) -> Iterator[dict[str, Any]]:
    """A staff user who may only look (``viewer``), one who may also retry parked rows
    (``retrier``, no discard) and a superuser (``root``); Django's tables migrated."""
    from django.contrib.auth.models import Permission, User
    from django.core.management import call_command

    call_command("migrate", verbosity=0)  # the toolkit's history is at head: a no-op for it

    def staff(name: str, *perms: str) -> Any:
        user = User.objects.create_user(name, password="pw", is_staff=True)
        user.user_permissions.set(Permission.objects.filter(codename__in=perms))
        return user

    yield {
        "viewer": staff("viewer", "view_parkedevent", "view_idempotencykey",
                        "view_handleddeadletter"),
        "retrier": staff("retrier", "view_parkedevent", "retry_parked"),
        "root": User.objects.create_superuser("root", password="pw"),
    }  # fmt: skip
