"""Pure parts of ``outbox status`` and ``outbox gc``: durations, the retention rule, reports."""

from __future__ import annotations

import io
from datetime import UTC, datetime

import pytest
from hypothesis import given, strategies as st

from outbox import admin, cli
from outbox._core import durations as durations_mod, environment
from outbox.admin import DEFAULT_LANES, RelayInfo
from outbox.cli import gc as gc_cli
from outbox.cli._common import FLAGS
from outbox.config import DEFAULT_CACHE_TTL_SECONDS, OutboxConfig
from outbox.errors import ConfigurationError

# ------------------------------------------------------------------------------ durations


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("7d", 7 * 86400),
        ("36h", 36 * 3600),
        ("90m", 5400),
        ("45s", 45),
        ("1w", 7 * 86400),
        ("1d12h", 36 * 3600),
        ("1h30m15s", 5415),
        ("1.5h", 5400),
        (" 2D ", 2 * 86400),
        ("86400", 86400),
        ("0.5", 0.5),
    ],
)
def test_parse_duration_accepts_units_and_bare_seconds(text: str, seconds: float) -> None:
    assert admin.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "d", "7", "7x", "-1d", "0d", "0", "1d-2h", "7 days", "h7"])
def test_parse_duration_refuses_junk_with_the_accepted_forms(text: str) -> None:
    if text == "7":  # a bare number is seconds: valid
        assert admin.parse_duration(text) == 7
        return
    with pytest.raises(ConfigurationError) as err:
        admin.parse_duration(text)
    assert "7d" in str(err.value) or "longer than zero" in str(err.value)


@given(st.integers(min_value=1, max_value=10**8))
def test_format_then_parse_round_trips_whole_seconds(seconds: int) -> None:
    text = admin.format_duration(seconds)
    assert admin.parse_duration(text) == seconds


@given(
    st.lists(
        st.tuples(st.integers(min_value=0, max_value=1000), st.sampled_from("wdhms")),
        min_size=1,
        max_size=5,
    )
)
def test_compound_durations_add_up(parts: list[tuple[int, str]]) -> None:
    total = sum(n * durations_mod._UNITS[u] for n, u in parts)
    text = "".join(f"{n}{u}" for n, u in parts)
    if total == 0:
        with pytest.raises(ConfigurationError):
            admin.parse_duration(text)
    else:
        assert admin.parse_duration(text) == total


def test_format_duration_reads_well() -> None:
    assert admin.format_duration(7 * 86400) == "7d"
    assert admin.format_duration(36 * 3600) == "1d12h"
    assert admin.format_duration(5400) == "1h30m"
    assert admin.format_duration(2.5) == "2.5s"
    assert admin.format_duration(0) == "0s"


# ------------------------------------------------------------------------- retention rule

DAY = 86400.0
durations = st.floats(min_value=1.0, max_value=365 * DAY, allow_nan=False)


@given(durations, durations, durations)
def test_retention_is_refused_exactly_when_a_duplicate_could_run_twice(
    older_than: float, cache_ttl: float, window: float
) -> None:
    unsafe = older_than <= cache_ttl or older_than < window
    if unsafe:
        with pytest.raises(admin.RetentionError):
            admin.check_retention(older_than, cache_ttl, window)
    else:
        admin.check_retention(older_than, cache_ttl, window)


def test_refusal_names_the_limit_and_why() -> None:
    with pytest.raises(admin.RetentionError) as err:
        admin.check_retention(12 * 3600, DAY, DAY)
    text = str(err.value)
    assert "cache TTL (1d" in text and "OUTBOX_CACHE_TTL" in text and "twice" in text

    with pytest.raises(admin.RetentionError) as err:
        admin.check_retention(2 * DAY, DAY, 7 * DAY)
    text = str(err.value)
    assert "redelivery window (7d" in text and "OUTBOX_MIN_REDELIVERY_WINDOW" in text
    assert "twice" in text


def test_defaults_accept_the_default_retention_and_match_outbox_config() -> None:
    config = OutboxConfig()
    assert config.cache_ttl == DEFAULT_CACHE_TTL_SECONDS
    admin.check_retention(
        config.retention, config.cache_ttl, admin.DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS
    )
    with pytest.raises(admin.RetentionError):
        admin.check_retention(
            config.cache_ttl, config.cache_ttl, admin.DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS
        )


# ------------------------------------------------------------------------------ status


def test_status_reads_the_relays_lane_variable() -> None:
    assert FLAGS["lanes"].env == environment.ENV_RELAY_LANES


def test_choose_lanes_prefers_flag_then_env_then_live_relays_then_default() -> None:
    assert admin.choose_lanes(8, "16", [4]) == (8, "flag")
    assert admin.choose_lanes(None, "16", [4]) == (16, "env")
    assert admin.choose_lanes(None, None, [4]) == (4, "relays")
    assert admin.choose_lanes(None, None, [4, 8]) == (DEFAULT_LANES, "default")
    assert admin.choose_lanes(None, None, []) == (DEFAULT_LANES, "default")
    with pytest.raises(ConfigurationError, match="OUTBOX_RELAY_LANES"):
        admin.choose_lanes(None, "many", [])
    with pytest.raises(ConfigurationError, match="--lanes"):
        admin.choose_lanes(0, None, [])


def test_format_ranges() -> None:
    assert admin.format_ranges([0, 1, 2, 3, 7, 9, 10]) == "0-3,7,9-10"
    assert admin.format_ranges([5]) == "5"
    assert admin.format_ranges([]) == "-"


def _status(**changes: object) -> admin.Status:
    base = admin.Status(
        schema=None,
        revision="0002",
        head_revision="0002",
        lanes=4,
        lanes_source="relays",
        relay_lane_counts=(4,),
        topics=(admin.TopicBacklog("orders", 5, 1, 3.25),),
        lane_backlog=(admin.LaneBacklog(0, 3, 0), admin.LaneBacklog(2, 2, 1)),
        oldest_pending_age=3.25,
        keys=(admin.ScopeKeys("billing", "completed", 7), admin.ScopeKeys("billing", "failed", 2)),
        oldest_key_age=60.0,
        relays=(RelayInfo(101, "outbox-relay", "10.0.0.5", (0, 1)),),
        taken_at=datetime(2025, 1, 1, tzinfo=UTC),
    )
    from dataclasses import replace

    return admin._status._with_warnings(replace(base, **changes))  # type: ignore[arg-type]


def test_warnings_point_at_the_fix() -> None:
    warnings = _status().warnings
    assert any("lanes 2 have pending rows but no relay holds them" in w for w in warnings)
    assert any("outbox parked list" in w for w in warnings)
    assert not any("outbox migrate" in w for w in warnings)

    stale = _status(revision="0001").warnings
    assert any("run `outbox migrate`" in w for w in stale)
    idle = _status(relays=(), relay_lane_counts=()).warnings
    assert any("no relay is running" in w for w in idle)
    split = _status(relay_lane_counts=(4, 8)).warnings
    assert any("disagree on --lanes (4, 8)" in w for w in split)


def test_the_parked_warning_counts_one_row_in_the_singular() -> None:
    one = admin.TopicBacklog("orders", 5, 1, 3.25)
    two = admin.TopicBacklog("orders", 5, 2, 3.25)
    assert any(w.startswith("1 parked row holds back") for w in _status(topics=(one,)).warnings)
    assert any(w.startswith("2 parked rows hold back") for w in _status(topics=(two,)).warnings)


def test_json_document_shape() -> None:
    doc = admin.status_to_json(_status(), "postgresql+psycopg://u:secret@db/app")
    assert doc["version"] == 1
    assert doc["database"] == "postgresql+psycopg://u:***@db/app"
    assert doc["outbox"] == {
        "pending": 5,
        "parked": 1,
        "oldest_pending_age_seconds": 3.25,
        "topics": [
            {"topic": "orders", "pending": 5, "parked": 1, "oldest_pending_age_seconds": 3.25}
        ],
    }
    assert doc["lanes"]["backlog"] == [
        {"lane": 0, "pending": 3, "parked": 0, "owner_pid": 101},
        {"lane": 2, "pending": 2, "parked": 1, "owner_pid": None},
    ]
    assert doc["idempotency_keys"]["by_status"] == {"completed": 7, "failed": 2, "started": 0}
    assert doc["idempotency_keys"]["total"] == 9
    assert doc["relays"] == [
        {
            "pid": 101,
            "application_name": "outbox-relay",
            "client_addr": "10.0.0.5",
            "lanes": [0, 1],
            "engine": "claim",
        }
    ]
    assert doc["windows"] is None  # no window relay ran


def test_human_report_is_compact_and_redacted() -> None:
    text = admin.render_status(_status(), "postgresql+psycopg://u:secret@db/app")
    assert "secret" not in text
    assert "pending 5  parked 1  oldest pending 3.2s" in text
    assert "RELAYS  alive 1" in text
    lines = text.splitlines()
    relay_line = next(line for line in lines if line.strip().startswith("101"))
    assert "0-1" in relay_line and "10.0.0.5" in relay_line
    lane_two = next(line for line in lines if line.split()[:1] == ["2"])
    assert lane_two.split() == ["2", "2", "1", "-"]


# --------------------------------------------------------------------------------- gc CLI


def test_progress_bar_on_a_terminal_and_plain_lines_elsewhere() -> None:
    bar = gc_cli.Progress(200, io.StringIO(), tty=True, width=10)
    assert bar.line(100).startswith("[#####.....]  50%  100/200 keys")
    plain = gc_cli.Progress(200, io.StringIO(), tty=False)
    assert plain.line(200).startswith("gc: deleted 200 of 200 keys (100%")


def test_gc_refuses_short_retention_before_touching_the_database(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (
        environment.ENV_CACHE_TTL,
        environment.ENV_MIN_REDELIVERY_WINDOW,
        environment.ENV_RETENTION,
    ):
        monkeypatch.delenv(name, raising=False)
    # An unroutable URL: reaching the database would fail with exit 1, not 3.
    url = "postgresql+psycopg://postgres@192.0.2.1:1/none"
    assert cli.main(["gc", "--database-url", url, "--older-than", "12h"]) == 3
    assert "cache TTL (1d" in capsys.readouterr().err
    assert cli.main(["gc", "--database-url", url, "--older-than", "2d"]) == 3
    assert "redelivery window (7d" in capsys.readouterr().err
    monkeypatch.setenv(environment.ENV_MIN_REDELIVERY_WINDOW, "36h")
    monkeypatch.setenv(environment.ENV_CACHE_TTL, "1h")
    assert cli.main(["gc", "--database-url", url, "--older-than", "1d"]) == 3
    assert "redelivery window (1d12h" in capsys.readouterr().err


def test_gc_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    url = "postgresql+psycopg://postgres@192.0.2.1:1/none"
    assert cli.main(["gc", "--database-url", url, "--older-than", "soon"]) == 2
    assert "--older-than: invalid duration 'soon'" in capsys.readouterr().err
    assert cli.main(["gc", "--database-url", url, "--older-than", "8d", "--batch-size", "0"]) == 2
