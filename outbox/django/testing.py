"""pytest helpers for Django projects: Django's connection on the plugin's per-test database.

``pytest_plugins = ["outbox.django.testing"]`` in a ``conftest.py`` (beside the ``outbox.testing``
plugin, which pytest loads by itself), with ``DJANGO_SETTINGS_MODULE`` set and Django set up.
``outbox_django_db`` points the ``DATABASES`` alias of the outbox at a fresh copy of the
template database for each test (the toolkit's tables migrated, and, with
:func:`template_setup` in the project's ``outbox_template_setup``, the project's own tables);
pytest-django's database blocker, if that plugin is installed, is lifted for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from django.core.management import call_command
from django.db import connections

from outbox.django import _settings


def point(alias: str, url: str) -> None:
    """Point Django's connection ``alias`` at the database of ``url`` (closing it first)."""
    parts = sa.make_url(url)
    connection = connections[alias]
    connection.close()
    connection.settings_dict.update(
        NAME=parts.database, USER=parts.username or "", PASSWORD=parts.password or "",
        HOST=parts.host or "", PORT=str(parts.port or ""),
    )  # fmt: skip


def template_setup(
    request: pytest.FixtureRequest, alias: str | None = None
) -> Callable[[str], None]:
    """What the project's ``outbox_template_setup`` fixture returns: ``manage.py migrate`` on
    the template database (once per session; every test's database copies it)."""

    def setup(url: str) -> None:
        chosen = _settings.alias_of(alias)
        with _unblocked(request):
            point(chosen, url)
            try:
                call_command("migrate", database=chosen, verbosity=0)
            finally:
                connections[chosen].close()
                _settings.reset()

    return setup


def _unblocked(request: pytest.FixtureRequest) -> contextlib.AbstractContextManager[object]:
    """pytest-django's database blocker lifted, when that plugin is installed."""
    if request.config.pluginmanager.hasplugin("django"):
        return request.getfixturevalue("django_db_blocker").unblock()  # type: ignore[no-any-return]
    return contextlib.nullcontext()


@pytest.fixture
def outbox_django_db(request: pytest.FixtureRequest, outbox_database_url: str) -> Iterator[str]:
    """Django's outbox alias on this test's database; yields its URL."""
    alias = _settings.alias_of(None)
    with _unblocked(request):
        point(alias, outbox_database_url)
        try:
            yield outbox_database_url
        finally:
            connections.close_all()
            _settings.reset()
