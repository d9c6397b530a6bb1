"""A migrated database per test: copies of one template migrated once per session."""

from __future__ import annotations

import os
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa

from outbox import migrate
from outbox._core.environment import ENV_DATABASE_URL
from outbox.config import normalize_database_url
from outbox.errors import ConfigurationError

if TYPE_CHECKING:
    from outbox.embedded import EmbeddedServer

ENV_TESTING_DATABASE_URL = "OUTBOX_TESTING_DATABASE_URL"
ENV_TESTING_REDIS_URL = "OUTBOX_TESTING_REDIS_URL"
ENV_TESTING_BOOTSTRAP = "OUTBOX_TESTING_KAFKA_BOOTSTRAP_SERVERS"
ENV_TESTING_EMBEDDED_DIR = "OUTBOX_TESTING_EMBEDDED_DIR"


class TemplateDatabases:
    """Per-test databases copied from one template migrated to the package's head revision.

    ``setup(url)`` runs once on the template after the migrations (your own tables).
    Names carry the process id and a random part, so concurrent sessions never collide.
    """

    def __init__(self, server_url: str, setup: Callable[[str], None] | None = None) -> None:
        self.server_url = normalize_database_url(server_url)
        self._setup = setup
        self._admin = sa.create_engine(
            self.server_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool
        )
        self._run = f"{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self._count = 0
        self._lock = threading.Lock()
        self.template: str | None = None

    def url_for(self, name: str) -> str:
        """The server URL with its database replaced by ``name``."""
        url = sa.make_url(self.server_url).set(database=name)
        return url.render_as_string(hide_password=False)

    def _execute(self, statement: str) -> None:
        with self._admin.connect() as conn:
            conn.execute(sa.text(statement))

    def _name(self, kind: str) -> str:
        with self._lock:
            self._count += 1
            return f"outbox_testing_{kind}_{self._run}_{self._count}"

    def create_template(self) -> str:
        """Create and migrate the template (once)."""
        if self.template is None:
            name = self._name("tpl")
            self._execute(f'CREATE DATABASE "{name}"')
            try:
                migrate.upgrade(self.url_for(name))
                if self._setup is not None:
                    self._setup(self.url_for(name))
                    # A pooled connection the setup left open would make every copy fail
                    # ("source database is being accessed by other users").
                    with self._admin.connect() as conn:
                        conn.execute(
                            sa.text(
                                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                "WHERE datname = :name AND pid <> pg_backend_pid()"
                            ),
                            {"name": name},
                        )
            except BaseException:
                self._execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                raise
            self.template = name
        return self.template

    def create(self) -> str:
        """A new copy of the template; returns its URL."""
        template = self.create_template()
        name = self._name("db")
        self._execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        return self.url_for(name)

    def drop(self, url: str) -> None:
        """Drop the database of ``url`` (and whatever is still connected to it)."""
        name = sa.make_url(url).database
        self._execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def close(self) -> None:
        try:
            if self.template is not None:
                self._execute(f'DROP DATABASE IF EXISTS "{self.template}" WITH (FORCE)')
                self.template = None
        finally:
            self._admin.dispose()


def server_url() -> str:
    """The PostgreSQL server of the tests: ``OUTBOX_TESTING_DATABASE_URL``, else
    ``OUTBOX_DATABASE_URL``, else an embedded server (the ``embedded`` extra), else a usage
    error that says what to set."""
    url = os.environ.get(ENV_TESTING_DATABASE_URL) or os.environ.get(ENV_DATABASE_URL)
    if url:
        return url
    try:
        return embedded_server().url
    except ConfigurationError as exc:
        raise pytest.UsageError(
            f"outbox.testing needs a PostgreSQL server: set {ENV_TESTING_DATABASE_URL} (or "
            f"{ENV_DATABASE_URL}) to a URL such as postgresql://postgres@127.0.0.1:5432/postgres "
            f"(each test gets a database of its own there), or {exc}"
        ) from None


def embedded_directory() -> Path:
    """Where the embedded test server keeps its data: one folder per user, shared by every
    session and pytest-xdist worker of that user (``OUTBOX_TESTING_EMBEDDED_DIR`` to move it)."""
    configured = os.environ.get(ENV_TESTING_EMBEDDED_DIR)
    if configured:
        return Path(configured)
    user = os.getuid() if hasattr(os, "getuid") else os.getpid()
    return Path(tempfile.gettempdir()) / f"outbox-testing-{user}" / "pg"


def embedded_server() -> EmbeddedServer:
    """The embedded PostgreSQL of this user's test runs, started (or joined) once per process.

    pytest-xdist workers share one server: the first to arrive initializes and starts it under
    an inter-process lock, the others join it, and it stops when the last of them exits. Test
    databases carry the process id in their names, so workers never collide on it.
    """
    global _EMBEDDED
    if _EMBEDDED is None:
        from outbox.embedded import start_postgres  # deferred: only without a configured server

        _EMBEDDED = start_postgres(embedded_directory())
    return _EMBEDDED


_EMBEDDED: EmbeddedServer | None = None


def started_embedded() -> EmbeddedServer | None:
    """The embedded server this process started or joined, if any."""
    return _EMBEDDED
