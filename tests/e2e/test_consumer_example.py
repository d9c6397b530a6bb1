"""The order-service example runs as its README says: relay, consumers, duplicates absorbed."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "examples" / "order_service" / "demo.py"


def _number(report: str, label: str) -> int:
    found = re.search(rf"^{re.escape(label)}:\s+(\d+)", report, re.MULTILINE)
    assert found, f"no {label!r} line in:\n{report}"
    return int(found.group(1))


@pytest.mark.slow
def test_order_service_example_applies_each_order_once(
    database_url: str, redis_url: str, kafka_bootstrap: str
) -> None:
    # The broker is shared by the session: topics and groups of this run's own.
    suffix = f".test-{uuid.uuid4().hex[:8]}"
    result = subprocess.run(
        [sys.executable, str(DEMO), "--database-url", database_url, "--redis-url", redis_url,
         "--bootstrap-servers", kafka_bootstrap, "--kafka-config", "session.timeout.ms=6000",
         "--orders", "150", "--duplicates", "0.4", "--timeout", "90", "--topic-suffix", suffix],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    report = result.stdout
    assert result.returncode == 0, f"{report}\n{result.stderr[-3000:]}"
    sent = _number(report, "order requests sent")
    assert _number(report, "distinct valid orders") == 150
    assert _number(report, "order rows written") == 150
    assert _number(report, "shipment rows written") == 150
    # 40% of the orders re-sent, some of them twice: at least 60 duplicates, all absorbed.
    assert sent - 150 - 1 >= 60
    assert _number(report, "duplicates absorbed") == sent - 150 - 1
    assert _number(report, "dead-lettered") == 1
    assert f"order.requests{suffix}.dlq" in report
    assert "OK: one order and one shipment per request" in report
