"""The relayed-per-minute chart: samples of a cumulative counter put in minute buckets."""

from __future__ import annotations

from hypothesis import given, strategies as st

from outbox.console.chart import WINDOW_MINUTES, Sample, Samples, per_minute, svg_bars

NOW = 1_800_000_000.0  # a minute boundary


def test_differences_land_in_the_minute_they_were_seen() -> None:
    samples = [Sample(NOW - 125, 10), Sample(NOW - 65, 15), Sample(NOW - 5, 40)]
    buckets = per_minute(samples, NOW)
    assert len(buckets) == WINDOW_MINUTES
    # the last bucket is the minute now is in: nothing seen in it yet
    assert buckets[-4:] == [None, 5, 25, None]


def test_a_counter_reset_adds_nothing_and_old_samples_fall_out() -> None:
    samples = [Sample(NOW - 7200, 0), Sample(NOW - 3700, 999), Sample(NOW + 30, 3)]
    assert per_minute(samples, NOW)[-1] == 0
    assert sum(v or 0 for v in per_minute(samples, NOW)) == 0


def test_samples_keep_time_order() -> None:
    samples = Samples()
    samples.add(10.0, 1)
    samples.add(5.0, 2)
    assert [s.at for s in samples.snapshot()] == [10.0]


@given(st.lists(st.one_of(st.none(), st.integers(0, 10**9)), max_size=WINDOW_MINUTES))
def test_the_svg_has_one_bar_per_measured_minute(values: list[int | None]) -> None:
    svg = svg_bars(values)
    assert svg.startswith('<svg id="relayed-chart"') and svg.endswith("</svg>")
    assert svg.count("<rect ") == sum(v is not None for v in values)
