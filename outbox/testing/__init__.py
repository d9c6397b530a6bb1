"""Test your own handlers against the real unit of work: a pytest plugin and its helpers.

Invariant: the plugin adds fixtures and nothing else -- no hook changes a run, and no fixture
does anything until a test asks for it. ``docs/testing.md`` lists the fixtures and how the
plugin is loaded.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import sqlalchemy as sa

    from outbox.testing._names import (
        ENV_TESTING_BOOTSTRAP,
        ENV_TESTING_DATABASE_URL,
        ENV_TESTING_REDIS_URL,
        AsyncOutbox,
        Deliverer,
        Delivery,
        Outbox,
        Published,
        PublishedEvent,
        TemplateDatabases,
        assert_one_effect_per_key,
        decode_event,
        relay_outbox,
    )

__all__ = [
    "ENV_TESTING_BOOTSTRAP",
    "ENV_TESTING_DATABASE_URL",
    "ENV_TESTING_REDIS_URL",
    "Deliverer",
    "Delivery",
    "Published",
    "PublishedEvent",
    "TemplateDatabases",
    "assert_one_effect_per_key",
    "decode_event",
    "relay_outbox",
]


def _api() -> ModuleType:
    """The module of the public names, loaded on first use, not with the plugin: pytest loads
    the plugin in every run of an environment where outbox-kit is installed, and those runs
    must not pay for (or depend on) the Kafka client, the relay or the consumer stack."""
    from outbox.testing import _names as api  # deferred: see the docstring

    return api


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(_api(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say which PostgreSQL the tests ran on when this plugin started an embedded one."""
    databases = sys.modules.get("outbox.testing.databases")  # loaded only if a test needed it
    server = databases.started_embedded() if databases is not None else None
    if server is not None:
        terminalreporter.write_line(server.describe("OUTBOX_TESTING_DATABASE_URL"))


@pytest.fixture(scope="session")
def outbox_template_setup() -> Callable[[str], None] | None:
    """Override to prepare the template database after the migrations: return a function of
    the template's URL that creates your tables (see ``docs/testing.md``). Connections it leaves
    open to the template are closed afterwards (a template must have none to be copied)."""
    return None


@pytest.fixture(scope="session")
def outbox_databases(
    outbox_template_setup: Callable[[str], None] | None,
) -> Iterator[TemplateDatabases]:
    """The session's :class:`TemplateDatabases` (the template is created on first use)."""
    api = _api()
    databases = api.TemplateDatabases(api.server_url(), outbox_template_setup)
    try:
        yield databases
    finally:
        databases.close()


@pytest.fixture
def outbox_database_url(outbox_databases: TemplateDatabases) -> Iterator[str]:
    """URL of a migrated database of this test's own (dropped afterwards)."""
    url = outbox_databases.create()
    try:
        yield url
    finally:
        outbox_databases.drop(url)


@pytest.fixture
def outbox_engine(outbox_database_url: str) -> Iterator[sa.Engine]:
    """A SQLAlchemy engine on the test's database."""
    engine = _api().create_engine(outbox_database_url)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def outbox(outbox_database_url: str) -> Iterator[Outbox]:
    """An :class:`~outbox.Outbox` on the test's database (Redis from
    ``OUTBOX_TESTING_REDIS_URL`` when set; the relay is not woken: no relay runs)."""
    api = _api()
    redis_url = os.environ.get(api.ENV_TESTING_REDIS_URL) or None
    prefix = f"outbox-testing-{uuid.uuid4().hex}"
    config = api.OutboxConfig(wake_relays=False, cache_prefix=prefix)
    ob = api.Outbox(outbox_database_url, redis_url=redis_url, config=config)
    try:
        yield ob
    finally:
        ob.close()


@pytest.fixture
def sync_outbox(outbox: Outbox) -> Outbox:
    """The :class:`~outbox.Outbox` of the ``outbox`` fixture, under a name that does not hide
    the ``outbox`` module in the test that takes it."""
    return outbox


@pytest.fixture
def async_outbox(outbox_database_url: str) -> Iterator[AsyncOutbox]:
    """An :class:`~outbox.AsyncOutbox` on the test's database.

    Its engine keeps no connection between units of work (``NullPool``) and it has no Redis
    client, so nothing outlives the event loop the test ran it on: it works with
    ``asyncio.run`` in a plain test, pytest-asyncio or anyio alike, and needs no closing.
    """
    api = _api()
    engine = api.create_async_engine(outbox_database_url, poolclass=api.NullPool)
    aob = api.AsyncOutbox(engine, config=api.OutboxConfig(wake_relays=False))
    try:
        yield aob
    finally:
        engine.sync_engine.dispose()


@pytest.fixture
def published(outbox: Outbox) -> Published:
    """The events in the test's outbox (:class:`Published`)."""
    events: Published = _api().Published(outbox.engine, outbox.config.schema)
    return events


@pytest.fixture
def deliver(outbox: Outbox) -> Deliverer:
    """``deliver(handler, value, key=..., headers=...) -> Delivery``: one message through the
    consumer runner's own code and the real unit of work, without a broker
    (:class:`Deliverer`; ``deliver.deliver_many(...)`` for redeliveries)."""
    deliverer: Deliverer = _api().Deliverer(outbox)
    return deliverer


@pytest.fixture
def relay_once(outbox_database_url: str) -> Callable[..., int]:
    """``relay_once(bootstrap_servers=None, **relay_config) -> confirmed``: drain the test's
    outbox to a real broker (:func:`relay_outbox`)."""

    def run(bootstrap_servers: str | None = None, **config: Any) -> int:
        confirmed: int = _api().relay_outbox(outbox_database_url, bootstrap_servers, **config)
        return confirmed

    return run
