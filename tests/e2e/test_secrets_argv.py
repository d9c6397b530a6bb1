"""Secrets given as flags do not stay in the process's command line: a real ``outbox-relay``
started with a database password and a SASL password as flags rewrites its title, and
``/proc/<pid>/cmdline`` -- what ``ps`` shows every local user -- holds neither."""

from __future__ import annotations

import urllib.error
import urllib.request
import uuid
from pathlib import Path

from tests.fixtures.common import free_port, wait_for
from tests.fixtures.relay import start_relay


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def test_a_relay_given_secrets_as_flags_hides_them_from_its_command_line(
    database_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    password = f"pw-{uuid.uuid4().hex}"
    sasl = f"sasl-{uuid.uuid4().hex}"
    # Local PostgreSQL trusts loopback connections: any password works.
    url = database_url.replace("postgres@", f"postgres:{password}@", 1)
    port = free_port()
    proc = start_relay(
        url, kafka_bootstrap, "--metrics-port", str(port), "--kafka-config",
        f"sasl.password={sasl}", log_path=tmp_path / "relay.log",
    )  # fmt: skip
    try:
        wait_for(lambda: proc.poll() is not None or _healthy(port), 60, "relay never healthy")
        assert proc.poll() is None, (tmp_path / "relay.log").read_text()
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert password.encode() not in cmdline and sasl.encode() not in cmdline
        assert b"postgres:***@" in cmdline and b"sasl.password=***" in cmdline
        assert f"--metrics-port {port}".encode() in cmdline  # the rest is still there
        log = (tmp_path / "relay.log").read_text()
        assert password not in log and sasl not in log
    finally:
        proc.terminate()
        proc.wait(30)
