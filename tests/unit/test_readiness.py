"""The relay's readiness verdict and the server's ``/readyz`` answer, without services (the
e2e tests drive both through real outages: tests/e2e/test_readiness.py)."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from outbox._metrics_server import MetricsServer
from outbox.relay._metrics import RelayMetrics


@pytest.mark.parametrize(
    ("database_up", "broker_up", "stopping", "ready"),
    [
        (True, True, False, True),
        (False, True, False, False),  # no database session, so not registered for lanes either
        (True, False, False, False),  # the broker did not answer its last check
        (True, True, True, False),  # asked to stop: finishing the batch in hand
    ],
)
def test_relay_is_ready_only_live_registered_and_reaching_the_broker(
    database_up: bool, broker_up: bool, stopping: bool, ready: bool
) -> None:
    metrics = RelayMetrics(max_silence=30.0)
    metrics.database_up, metrics.broker_up, metrics.stopping = database_up, broker_up, stopping
    metrics.beat()
    assert metrics.ready(30.0) is ready
    assert metrics.registry.get_sample_value("outbox_relay_ready") == float(ready)


def test_a_wedged_loop_is_not_ready() -> None:
    metrics = RelayMetrics(max_silence=30.0)
    metrics.database_up = metrics.broker_up = True
    metrics.heartbeat -= 31.0  # the loop last turned 31 s ago
    assert not metrics.ready(30.0)
    assert metrics.registry.get_sample_value("outbox_relay_ready") == 0.0


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def test_readyz_answers_the_verdict_apart_from_healthz() -> None:
    metrics = RelayMetrics()
    metrics.database_up = True
    metrics.beat()
    server = MetricsServer(metrics, 0, host="127.0.0.1").start()
    try:
        assert _get(server.port, "/healthz") == (200, "ok\n")
        assert _get(server.port, "/readyz") == (503, "not ready\n")  # no broker check yet
        metrics.broker_up = True
        assert _get(server.port, "/readyz") == (200, "ready\n")
        assert "outbox_relay_ready 1.0" in _get(server.port, "/metrics")[1]
    finally:
        server.close()


def test_the_window_reclaim_age_is_zero_unless_the_relay_runs_the_window_engine() -> None:
    """A claim relay never reclaims: an age that grew from its start would page someone."""
    metrics = RelayMetrics(max_silence=30.0)

    def age() -> float:
        value = metrics.registry.get_sample_value("outbox_relay_window_reclaim_age_seconds")
        assert value is not None
        return value

    assert age() == 0.0
    metrics.window_engine()
    metrics._window_reclaimed_at = (metrics._window_reclaimed_at or 0.0) - 100
    assert age() >= 100
    metrics.window_reclaims(truncated=True, deleted=0)
    assert age() < 100
