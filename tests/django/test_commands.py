"""The management commands as a user runs them (``python -m django ...``, the project's
settings): the relay, status, parked rows and dead letters, on the real PostgreSQL and broker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import sqlalchemy as sa

from outbox import migrate
from outbox.django import unit_of_work
from tests.django.conftest import count
from tests.fixtures.kafka import create_topic, read_to_end

ROOT = Path(__file__).resolve().parents[2]


def manage(database_url: str, bootstrap: str, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.django.project.settings",
        "OUTBOX_DATABASE_URL": database_url,
        "OUTBOX_TEST_KAFKA_BOOTSTRAP": bootstrap,
        "PYTHONPATH": str(ROOT),
    }
    return subprocess.run(
        [sys.executable, "-m", "django", *argv],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )  # fmt: skip


def test_outbox_relay_carries_a_django_unit_of_works_event_to_kafka(
    django_database: str, engine: sa.Engine, kafka_bootstrap: str
) -> None:
    topic = f"django-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, topic)
    with unit_of_work("relayed") as uow:
        event_id = uow.publish(topic, {"n": 1}, key="k")
    assert count(engine, "outbox") == 1
    done = manage(django_database, kafka_bootstrap, "outbox_relay", "--once")
    assert done.returncode == 0, done.stderr
    assert count(engine, "outbox") == 0
    records = read_to_end(kafka_bootstrap, topic, at_least=1)
    assert [json.loads(r.value()) for r in records] == [{"n": 1}]
    headers = dict(records[0].headers() or [])
    assert headers["X-Idempotency-Key"].decode() == str(event_id)


def test_status_parked_and_dlq_read_the_projects_database(
    django_database: str, engine: sa.Engine, kafka_bootstrap: str
) -> None:
    with unit_of_work("pending") as uow:
        uow.publish("django.pending", {"n": 1})
    done = manage(django_database, kafka_bootstrap, "outbox_status", "--json")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert "django.pending" in json.dumps(status)
    done = manage(django_database, kafka_bootstrap, "outbox_parked", "list", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
    assert manage(django_database, kafka_bootstrap, "outbox_dlq", "--help").returncode == 0


def test_a_command_on_an_unmigrated_database_says_run_migrate(
    django_database: str, engine: sa.Engine, kafka_bootstrap: str
) -> None:
    migrate.downgrade(engine, "base")
    done = manage(django_database, kafka_bootstrap, "outbox_status")
    assert done.returncode != 0
    assert "migrate" in done.stderr


def test_check_reports_a_database_the_migrations_have_not_reached(
    django_database: str, engine: sa.Engine, kafka_bootstrap: str
) -> None:
    done = manage(django_database, kafka_bootstrap, "check", "--database", "default")
    assert done.returncode == 0 and "outbox.W001" not in done.stderr, done.stderr
    migrate.downgrade(engine, "base")
    done = manage(django_database, kafka_bootstrap, "check", "--database", "default")
    assert "outbox.W001" in done.stderr and "manage.py migrate outbox" in done.stderr
    done = manage(django_database, kafka_bootstrap, "migrate", "outbox")
    assert done.returncode == 0, done.stderr
    done = manage(django_database, kafka_bootstrap, "check", "--database", "default")
    assert "outbox.W001" not in done.stderr
