"""``manage.py outbox_consume`` as a user runs it: duplicates and a SIGKILL in the middle of a
handler, and still one effect per key (the real broker, PostgreSQL and Redis)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import sqlalchemy as sa
from confluent_kafka import Producer

from tests.django.conftest import count
from tests.django.test_middleware_server import Hold
from tests.fixtures.common import wait_for
from tests.fixtures.kafka import create_topic

ROOT = Path(__file__).resolve().parents[2]


def consumer(
    database_url: str, bootstrap: str, topic: str, group: str, log: Path
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.django.project.settings",
        "OUTBOX_DATABASE_URL": database_url,
        "OUTBOX_TEST_KAFKA_BOOTSTRAP": bootstrap,
        "OUTBOX_TEST_CONSUMER": "1",
        "PYTHONPATH": str(ROOT),
    }
    argv = [sys.executable, "-m", "django", "outbox_consume",
            "tests.django.project.handlers:accept", "--topic", topic, "--group", group]  # fmt: skip
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def test_duplicates_and_a_sigkill_leave_one_effect_per_key(
    django_database: str, engine: sa.Engine, kafka_bootstrap: str, tmp_path: Path
) -> None:
    topic, group = f"django-in-{uuid.uuid4().hex[:8]}", f"django-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, topic)
    hold = Hold(engine)
    keys = [f"k{i}" for i in range(5)]
    sent = [*keys[:2], "k2-held", *keys[2:], *keys]  # every key twice, k2's first copy held
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for name in sent:
        key = name.removesuffix("-held")
        body = {"key": key, **({"hold": hold.id} if name.endswith("-held") else {})}
        producer.produce(topic, json.dumps(body).encode(), key=key.encode(),
                         headers={"X-Idempotency-Key": key})  # fmt: skip
    assert producer.flush(30) == 0
    log = tmp_path / "consumer.log"
    first = consumer(django_database, kafka_bootstrap, topic, group, log)
    try:
        backend = hold.wait_for_waiter()  # k2's handler holds its key, waiting for the test
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
        hold.release()

    def backend_gone() -> bool:
        with engine.connect() as conn:
            return not conn.execute(
                sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p"), {"p": backend}
            ).scalar()

    wait_for(backend_gone, 30, "the killed consumer's backend did not go away")
    assert count(engine, "shop_order") == 2  # k0 and k1 committed before the kill
    second = consumer(django_database, kafka_bootstrap, topic, group, log)
    try:
        wait_for(lambda: count(engine, "idempotency_keys") == 5, 60,
                 f"the restarted consumer did not finish:\n{log.read_text()[-3000:]}")  # fmt: skip
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0, log.read_text()[-3000:]
    assert count(engine, "shop_order") == 5 and count(engine, "outbox") == 5
    with engine.connect() as conn:
        stored = conn.execute(sa.text("SELECT key, result FROM idempotency_keys ORDER BY key"))
        assert [(k, r) for k, r in stored] == [(k, {"accepted": k}) for k in keys]
