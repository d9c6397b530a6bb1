"""``outbox-relay`` with no broker listening: one clear line soon after it starts, no line per
librdkafka retry while the outage lasts, and a prompt exit on SIGTERM (a real relay process,
real PostgreSQL, a loopback port nobody listens on)."""

from __future__ import annotations

import re
import signal
import socket
import threading
from datetime import datetime
from pathlib import Path

import sqlalchemy as sa

from tests.fixtures.common import wait_for
from tests.fixtures.relay import insert_rows, start_relay

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _at(log: str, needle: str) -> datetime:
    for line in log.splitlines():
        if needle in line and (found := STAMP.match(line)):
            return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f")
    raise AssertionError(f"no {needle!r} line in:\n{log}")


class RefusingBroker:
    """A loopback port that accepts each connection and closes it at once: a broker that is
    down, which counts the client's attempts (so the test waits for retries, not for time)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.attempts = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()
            self.attempts += 1

    def close(self) -> None:
        self.sock.close()


def test_a_dead_broker_gets_one_line_soon_and_sigterm_ends_the_relay_at_once(
    engine: sa.Engine, database_url: str, tmp_path: Path
) -> None:
    insert_rows(engine, "orders", [(f"k{i}", b"{}") for i in range(5)])
    log_path = tmp_path / "relay.log"
    broker = RefusingBroker()
    # librdkafka reconnects every 100-200 ms here: each attempt used to be a log line.
    relay = start_relay(
        database_url, broker.address, "--kafka-config", "reconnect.backoff.max.ms=200",
        "--poll-interval", "0.2", log_path=log_path,
    )  # fmt: skip
    try:
        wait_for(lambda: "kafka_unreachable" in log_path.read_text(), 30, "no word on Kafka")
        text = log_path.read_text()
        verdict = (_at(text, "kafka_unreachable") - _at(text, "relay_started")).total_seconds()
        assert verdict < 5.0, f"the first word on the dead broker came {verdict:.1f}s in"
        assert "Kafka unreachable" in text
        seen = broker.attempts
        wait_for(lambda: broker.attempts >= seen + 10, 60, "the relay stopped reconnecting")
    finally:
        relay.send_signal(signal.SIGTERM)
        code = relay.wait(30)
        broker.close()
    assert code == 0
    text = log_path.read_text()
    kafka_lines = [line for line in text.splitlines() if "kafka" in line.lower()]
    kafka_lines = [line for line in kafka_lines if "relay_started" not in line]
    assert len(kafka_lines) == 1, "\n".join(kafka_lines)
    stopped = (_at(text, "relay_stopped") - _at(text, "stop_requested")).total_seconds()
    assert stopped < 1.0, f"SIGTERM took {stopped:.2f}s to stop the relay"
