"""``outbox dlq list|redrive|discard`` as a user runs them, against the real broker and
PostgreSQL: dead letters as the consumer runner writes them are grouped by failure, sent back to
their original topic, or marked handled so that the listing leaves them out."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import sqlalchemy as sa

from outbox._core.deadletter_reading import REDRIVE_HEADER
from outbox.schema import tables
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


def handled_rows(engine: sa.Engine) -> list[tuple[int, int, str]]:
    t = tables(None).dlq_handled
    with engine.connect() as conn:
        rows = conn.execute(sa.select(t.c.partition, t.c.offset, t.c.how, t.c.handled_by))
        return sorted((r.partition, r.offset, r.how) for r in rows if "outbox dlq" in r.handled_by)


def test_discarded_and_redriven_groups_leave_the_listing(
    kafka_bootstrap: str, database_url: str, engine: sa.Engine
) -> None:
    topic = f"orders-{uuid.uuid4().hex[:8]}"
    dead = write_dead_letters(
        kafka_bootstrap,
        topic,
        [
            ("order-1", KeyError("'order-1' not in stock")),
            ("order-2", KeyError("'order-2' not in stock")),
            ("order-3", ValueError("price -4 is negative")),
            ("order-4", TypeError("no price")),
        ],
    )
    db = ("--database-url", database_url)
    groups = json.loads(dlq(kafka_bootstrap, "list", "--topic", dead, "--json", *db).stdout)
    by_type = {g["error_type"]: g["group"] for g in groups}
    stock, price, typed = by_type["KeyError"], by_type["ValueError"], by_type["TypeError"]

    dry = dlq(kafka_bootstrap, "discard", "--topic", dead, "--group", price, "--dry-run", *db)
    assert dry.returncode == 0 and "1 dead letter(s) would discard" in dry.stdout, dry.stderr
    assert handled_rows(engine) == []
    done = dlq(
        kafka_bootstrap, "discard", "--topic", dead, "--group", price, "--message", "0:3",
        "--json", *db,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "dry_run": False, "count": 2, "messages": ["0:2", "0:3"], "topics": [topic],
    }  # fmt: skip
    assert handled_rows(engine) == [(0, 2, "discarded"), (0, 3, "discarded")]

    listed = dlq(kafka_bootstrap, "list", "--topic", dead, *db)
    assert listed.returncode == 0, listed.stderr
    assert stock in listed.stdout and price not in listed.stdout and typed not in listed.stdout
    assert "2 handled dead letter(s) hidden (--all shows them)" in listed.stdout
    every = dlq(kafka_bootstrap, "list", "--topic", dead, "--all", "--json", *db)
    assert [(g["count"], g["handled"]) for g in json.loads(every.stdout)] == [
        (2, 0), (1, 1), (1, 1),
    ]  # fmt: skip

    again = dlq(kafka_bootstrap, "discard", "--topic", dead, "--group", price, *db)
    assert again.returncode == 1 and "matched nothing" in again.stdout, again.stderr

    redriven = dlq(kafka_bootstrap, "redrive", "--topic", dead, "--group", stock, *db)
    assert redriven.returncode == 0 and "2 dead letter(s) redriven" in redriven.stdout
    assert handled_rows(engine)[:2] == [(0, 0, "redriven"), (0, 1, "redriven")]
    empty = dlq(kafka_bootstrap, "list", "--topic", dead, *db)
    assert "no dead letters to handle" in empty.stdout
    assert "4 handled dead letter(s) hidden" in empty.stdout


def test_discard_refuses_bad_ids_and_refs_before_writing(
    kafka_bootstrap: str, database_url: str, engine: sa.Engine
) -> None:
    db = ("--database-url", database_url)
    for args, said in (
        ((), "--group"),
        (("--group", "ZZZ"), "is not a group id"),
        (("--group", "0123456789ab", "--message", "1:-2"), "PARTITION:OFFSET"),
    ):
        refused = dlq(kafka_bootstrap, "discard", "--topic", "orders.dlq", *args, *db)
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr
    no_db = dlq(kafka_bootstrap, "discard", "--topic", "orders.dlq", "--group", "0123456789ab")
    assert no_db.returncode == 2 and "--database-url is required" in no_db.stderr
    assert handled_rows(engine) == []
