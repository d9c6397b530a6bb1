"""``scripts/demo.py --quick``: the quick-start demo (the order-service example on embedded
defaults) as a user runs it, numbers checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
