"""``outbox dlq list|redrive`` as a user runs them, against the real broker: dead letters as the
consumer runner writes them are grouped by failure and sent back to their original topic."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

from outbox._core.dlq import REDRIVE_HEADER
from tests.fixtures.console import write_dead_letters
from tests.fixtures.kafka import read_to_end
from tests.fixtures.relay import REPO


def dlq(bootstrap: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox.cli", "dlq", *args, "--bootstrap-servers", bootstrap],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip


def test_dead_letters_are_grouped_and_a_group_is_redriven_to_its_topic(
    kafka_bootstrap: str,
) -> None:
    topic = f"orders-{uuid.uuid4().hex[:8]}"
    dead = write_dead_letters(
        kafka_bootstrap,
        topic,
        [
            ("order-1", KeyError("'order-1' not in stock")),
            ("order-2", KeyError("'order-2' not in stock")),
            ("order-3", ValueError("price -4 is negative")),
        ],
    )

    listed = dlq(kafka_bootstrap, "list", "--topic", dead, "--json")
    assert listed.returncode == 0, listed.stderr
    groups = json.loads(listed.stdout)
    assert [(g["error_type"], g["count"]) for g in groups] == [("KeyError", 2), ("ValueError", 1)]
    assert groups[0]["topic"] == topic and groups[0]["messages"] == ["0:0", "0:1"]

    dry = dlq(
        kafka_bootstrap, "redrive", "--topic", dead, "--group", groups[0]["group"], "--dry-run"
    )
    assert dry.returncode == 0 and "2 dead letter(s) would redrive" in dry.stdout, dry.stderr
    done = dlq(kafka_bootstrap, "redrive", "--topic", dead, "--group", groups[0]["group"])
    assert done.returncode == 0 and "2 dead letter(s) redriven" in done.stdout, done.stderr

    records = read_to_end(kafka_bootstrap, topic, at_least=2)
    assert sorted(r.key() for r in records) == [b"order-1", b"order-2"]  # the dry run sent none
    for record in records:
        headers = dict(record.headers())
        assert headers[REDRIVE_HEADER] == b"1" and headers["source"] == b"checkout"
        assert headers["X-Idempotency-Key"] == record.key()
        assert not [name for name in headers if name.startswith("outbox.dlq.")]
        assert record.value() == b'{"id": "' + record.key() + b'"}'


def test_redrive_needs_a_group_or_messages(kafka_bootstrap: str) -> None:
    refused = dlq(kafka_bootstrap, "redrive", "--topic", "orders.dlq")
    assert refused.returncode == 2 and "--group" in refused.stderr
    bad = dlq(kafka_bootstrap, "redrive", "--topic", "orders.dlq", "--message", "zero:1")
    assert bad.returncode == 2 and "PARTITION:OFFSET" in bad.stderr
