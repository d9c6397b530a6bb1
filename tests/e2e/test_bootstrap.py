"""``make demo``'s first steps (scripts/bootstrap.sh) on a machine whose installed PostgreSQL
cannot be started: the demo goes on (with its embedded server) instead of stopping, while
``make services`` still fails loudly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.common import free_port

REPO = Path(__file__).resolve().parents[2]

# What Debian's pg_ctlcluster says when the cluster's pid file names a running server.
BROKEN_PG_CTLCLUSTER = """#!/bin/sh
echo "Cluster is already running." >&2
exit 2
"""


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    if not Path("/etc/postgresql").is_dir():
        pytest.skip("the script only starts an installed PostgreSQL where /etc/postgresql is")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "pg_ctlcluster"
    fake.write_text(BROKEN_PG_CTLCLUSTER)
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    env["VENV"] = str(Path(sys.executable).parents[1])  # the suite's own: nothing to install
    env["OUTBOX_DEMO_LOCAL_POSTGRES"] = f"127.0.0.1:{free_port()}"  # nothing answers there
    return subprocess.run(
        ["bash", "scripts/bootstrap.sh", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_demo_falls_back_to_its_embedded_server_when_postgres_will_not_start(
    tmp_path: Path,
) -> None:
    done = _run(tmp_path, "demo", "--help")  # the demo's own --help: stops before any work
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PostgreSQL: the installed server did not start; the demo starts an embedded one" in (
        done.stdout
    )
    assert "usage:" in done.stdout


def test_make_services_still_fails_when_postgres_will_not_start(tmp_path: Path) -> None:
    done = _run(tmp_path, "services")
    assert done.returncode == 1
    assert "PostgreSQL did not start" in done.stderr
