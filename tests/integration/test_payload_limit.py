"""The payload limit at the door is the one the relay's producer can send: an event at the limit
commits and a real relay delivers it; one byte more is refused by ``publish()`` before anything
commits -- and the same event written past the door is what the relay parks as too large.

With librdkafka's default ``message.max.bytes`` (an in-process relay), and with one set in
``OUTBOX_KAFKA_CONFIG``, read by the ``Outbox`` and by ``outbox-relay --once`` alike.
"""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest
import sqlalchemy as sa

import outbox
from outbox._core.recordsize import wire_size
from outbox.admin import list_parked
from outbox.errors import PayloadTooLargeError
from outbox.relay import Relay, RelayConfig
from tests.fixtures.relay import REPO, insert_rows, outbox_count, relay_command, wait_for_records
from tests.fixtures.uow import count

HEADERS: dict[str, str | bytes] = {"content-type": "application/octet-stream", "source": "test"}


@pytest.mark.parametrize("configured", [None, 200_000], ids=["default", "OUTBOX_KAFKA_CONFIG"])
def test_the_door_refuses_exactly_what_the_relay_would_park(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    monkeypatch: pytest.MonkeyPatch,
    configured: int | None,
) -> None:
    if configured is None:
        monkeypatch.delenv("OUTBOX_KAFKA_CONFIG", raising=False)
    else:
        monkeypatch.setenv("OUTBOX_KAFKA_CONFIG", f"linger.ms=1,message.max.bytes={configured}")
    limit = configured or 1_000_000
    topic = f"payload-limit-{uuid.uuid4().hex[:8]}"
    room = limit - wire_size(b"k", b"", HEADERS)  # the largest value with key "k"

    with outbox.Outbox(engine) as ob:
        assert ob.config.max_payload_bytes == limit
        with ob.unit_of_work("at-limit") as uow:
            at_limit = uow.publish(topic, b"x" * room, key="k", headers=HEADERS)
        refused = pytest.raises(PayloadTooLargeError, match=f"the limit is {limit} bytes")
        with refused, ob.unit_of_work("over") as uow:
            uow.publish(topic, b"x" * (room + 1), key="k", headers=HEADERS)
    assert (count(engine, "idempotency_keys"), outbox_count(engine)) == (1, 1)
    # The same one byte more, written past the door: what the relay's producer refuses.
    (past_the_door,) = insert_rows(engine, topic, [("k2", b"x" * room)], HEADERS)

    if configured is None:
        assert Relay(RelayConfig(database_url, kafka_bootstrap)).run(once=True) == 0
    else:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env["OUTBOX_KAFKA_CONFIG"] = os.environ["OUTBOX_KAFKA_CONFIG"]
        done = subprocess.run(
            [*relay_command(database_url, kafka_bootstrap), "--once"],
            cwd=REPO, env=env, capture_output=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr

    (record,) = wait_for_records(kafka_bootstrap, topic, [at_limit])
    assert len(record.value) == room
    with engine.connect() as conn:
        (parked,) = list_parked(conn)
    assert parked.event_id == past_the_door
    assert "MSG_SIZE_TOO_LARGE" in (parked.error or "")
    assert outbox_count(engine) == 1  # only the parked row is left
