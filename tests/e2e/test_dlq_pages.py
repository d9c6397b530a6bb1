"""``outbox dlq list`` reads a page of dead letters: ``--limit`` counts only letters still to
handle, a page that stopped says where and how to go on (``--from``), so every dead letter is
reachable however many were handled before it; the table shows each failure once, with its
reason and a time that says its zone; ``outbox dlq`` and ``outbox parked`` list by default."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid

import sqlalchemy as sa

from tests.e2e.test_dlq_cli import dlq
from tests.fixtures.console import write_dead_letters
from tests.fixtures.relay import REPO

FAILURES: list[tuple[str, BaseException]] = [
    ("order-1", KeyError("'order-1' not in stock")),
    ("order-2", KeyError("'order-2' not in stock")),
    ("order-3", KeyError("'order-3' not in stock")),
    ("order-4", ValueError("price -4 is negative")),
    ("order-5", ValueError("price -5 is negative")),
]


def test_letters_past_the_limit_are_listed_once_the_ones_before_them_are_handled(
    kafka_bootstrap: str, database_url: str, engine: sa.Engine
) -> None:
    dead = write_dead_letters(kafka_bootstrap, f"orders-{uuid.uuid4().hex[:8]}", FAILURES)
    db = ("--database-url", database_url)

    first = dlq(kafka_bootstrap, "list", "--topic", dead, "--limit", "3", "--json", *db)
    assert first.returncode == 0, first.stderr
    assert [g["messages"] for g in json.loads(first.stdout)] == [["0:0", "0:1", "0:2"]]
    stock = json.loads(first.stdout)[0]["group"]
    done = dlq(kafka_bootstrap, "discard", "--topic", dead, "--group", stock, "--limit", "3", *db)
    assert done.returncode == 0 and "3 dead letter(s) discarded" in done.stdout, done.stderr

    # The handled letters use none of the budget: the newer ones are on the first page now.
    again = dlq(kafka_bootstrap, "list", "--topic", dead, "--limit", "3", "--json", *db)
    assert again.returncode == 0, again.stderr
    assert [g["messages"] for g in json.loads(again.stdout)] == [["0:3", "0:4"]]
    assert "stopped" not in again.stderr


def test_a_listing_that_stopped_at_the_limit_says_where_and_goes_on_from_there(
    kafka_bootstrap: str,
) -> None:
    dead = write_dead_letters(kafka_bootstrap, f"orders-{uuid.uuid4().hex[:8]}", FAILURES)
    first = dlq(kafka_bootstrap, "list", "--topic", dead, "--limit", "3", "--json")
    assert first.returncode == 0, first.stderr
    assert [g["messages"] for g in json.loads(first.stdout)] == [["0:0", "0:1", "0:2"]]
    assert "reading stopped after 3 dead letter(s) still to handle" in first.stderr
    assert "partition 0 from offset 3" in first.stderr
    assert "go on with --from 0:3" in first.stderr
    on = dlq(kafka_bootstrap, "list", "--topic", dead, "--limit", "3", "--from", "0:3", "--json")
    assert [g["messages"] for g in json.loads(on.stdout)] == [["0:3", "0:4"]], on.stderr
    assert "stopped" not in on.stderr
    bad = dlq(kafka_bootstrap, "list", "--topic", dead, "--from", "0:3,0:4")
    assert bad.returncode == 2 and "--from" in bad.stderr and "twice" in bad.stderr


def test_the_listing_shows_the_error_once_with_its_reason_and_a_time_in_utc(
    kafka_bootstrap: str,
) -> None:
    dead = write_dead_letters(kafka_bootstrap, f"orders-{uuid.uuid4().hex[:8]}", FAILURES[3:])
    listed = dlq(kafka_bootstrap, "list", "--topic", dead)
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()[:2]
    assert header.split()[:6] == ["GROUP", "COUNT", "HANDLED", "REASON", "TOPIC", "LAST"]
    assert "LAST SEEN (UTC)" in header
    assert "permanent-error" in row
    assert row.count("ValueError") == 1, row
    assert "ValueError: price -<n> is negative" in row
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ", row), row


def test_dlq_and_parked_without_an_action_list(kafka_bootstrap: str, database_url: str) -> None:
    dead = write_dead_letters(kafka_bootstrap, f"orders-{uuid.uuid4().hex[:8]}", FAILURES[3:])
    listed = subprocess.run(
        [sys.executable, "-m", "outbox.cli", "dlq", "--topic", dead, "--bootstrap-servers",
         kafka_bootstrap],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith("GROUP") and "ValueError" in listed.stdout
    parked = subprocess.run(
        [sys.executable, "-m", "outbox.cli", "parked", "--database-url", database_url],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert parked.returncode == 0, parked.stderr
    assert parked.stdout.strip() == "no parked rows"
