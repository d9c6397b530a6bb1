"""The outage log's decisions: a line when a dependency goes down, a summary while it stays
down, a line when it answers again -- never one per failed attempt."""

from __future__ import annotations

from hypothesis import given, strategies as st

from outbox._core.outage import Outage


def test_one_line_down_a_summary_while_it_lasts_and_one_line_back() -> None:
    outage = Outage("Kafka", summary_every=60)
    first = outage.failed("_TRANSPORT", "connection refused", now=0.0)
    assert first is not None and first.startswith("Kafka unreachable: connection refused")
    for t in range(1, 60):  # librdkafka's retries, alternating kinds
        kind = "_TRANSPORT" if t % 2 else "_ALL_BROKERS_DOWN"
        assert outage.failed(kind, "connection refused", now=float(t)) is None
    summary = outage.summary(now=61.0)
    assert summary == (
        "Kafka still unreachable after 61s: 60 failures (_TRANSPORT 31, _ALL_BROKERS_DOWN 29); "
        "last: connection refused"
    )
    assert outage.summary(now=62.0) is None
    assert outage.recovered(now=90.0) == "Kafka reachable again after 90s (60 failures meanwhile)"
    assert outage.recovered(now=91.0) is None
    assert not outage.down and outage.failed("_TRANSPORT", "again", now=100.0) is not None


@given(st.lists(st.floats(min_value=0, max_value=3600), max_size=200))
def test_at_most_one_line_per_summary_interval_plus_the_first(times: list[float]) -> None:
    outage = Outage("PostgreSQL", summary_every=30)
    lines = [t for t in sorted(times) if outage.failed("OperationalError", "down", t)]
    span = (max(times) - min(times)) if times else 0.0
    assert len(lines) <= 1 + span // 30
