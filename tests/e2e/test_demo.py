"""``scripts/demo.py --quick``: the quick-start demo (the order-service example on embedded
defaults) as a user runs it, numbers checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.common import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_demo_absorbs_duplicates_survives_a_relay_kill_and_loses_nothing(
    pg_admin_url: str, redis_url: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["OUTBOX_DATABASE_URL"] = pg_admin_url
    env["OUTBOX_REDIS_URL"] = redis_url
    # No OUTBOX_KAFKA_BOOTSTRAP_SERVERS: the demo starts its own broker, as on a fresh machine.
    done = subprocess.run(
        [sys.executable, "scripts/demo.py", "--quick", "--json", "--seed", "7"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    orders = 200
    assert summary["orders"] == orders
    assert summary["duplicate_deliveries"] >= 40  # 25% of the orders, some sent three times
    assert summary["invalid"] == 1
    assert summary["messages_in"] == orders + summary["duplicate_deliveries"] + 1
    assert summary["duplicates_absorbed"] == summary["duplicate_deliveries"]
    assert summary["dead_lettered"] == 1
    assert summary["orders_written"] == orders and summary["orders_applied_twice"] == 0
    assert summary["events_committed"] == orders
    assert summary["events_delivered"] == orders
    assert summary["downstream_applied"] == orders
    assert summary["downstream_applied_twice"] == 0
    assert summary["relay_kills"] == 1
    assert summary["lost"] == 0 and summary["lost_messages"] == 0
    assert "killed with SIGKILL" in done.stdout and "relay restarted" in done.stdout
    assert "lost:" in done.stdout


@pytest.mark.slow
def test_quick_demo_runs_on_embedded_servers_when_none_answers(embedded_home: Path) -> None:
    """A machine with Python and nothing else: no URL set, nothing answering where installed
    PostgreSQL and Redis would be; the demo starts both from the dev extra's wheels, says so,
    loses nothing, and stops PostgreSQL when it exits."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    closed_pg, closed_redis = free_port(), free_port()  # nothing listens there
    env["OUTBOX_DEMO_LOCAL_POSTGRES"] = f"127.0.0.1:{closed_pg}"
    env["OUTBOX_DEMO_LOCAL_REDIS"] = f"127.0.0.1:{closed_redis}"
    env["OUTBOX_DEMO_EMBEDDED_DIR"] = str(embedded_home)
    done = subprocess.run(
        [sys.executable, "scripts/demo.py", "--quick", "--json", "--seed", "7"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    pgdata = embedded_home / "pg"
    server_log = (pgdata / "log").read_text()[-3000:] if (pgdata / "log").exists() else ""
    assert done.returncode == 0, (
        done.stdout[-3000:] + done.stderr[-3000:] + "\n--- server log\n" + server_log
    )
    lines = done.stdout.splitlines()
    assert any(
        "PostgreSQL: embedded 18." in line and "OUTBOX_DATABASE_URL" in line for line in lines
    )
    assert any("Redis: embedded " in line and "OUTBOX_REDIS_URL" in line for line in lines)
    summary = json.loads(lines[-1])
    assert summary["orders_written"] == 200 and summary["events_delivered"] == 200
    assert summary["lost"] == 0 and summary["lost_messages"] == 0
    assert (pgdata / "PG_VERSION").read_text().strip() == "18"
    assert not (pgdata / "postmaster.pid").exists(), "the embedded PostgreSQL was left running"
