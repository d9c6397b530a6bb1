"""Configuration validation, URL handling and CLI flag parsing (no services)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from outbox import OutboxConfig
from outbox._core.claim import lock_id
from outbox._pg.statements import idempotency_key_complete, statements
from outbox.cli._common import parse_kafka_config
from outbox.config import POOLERS, ConsumerConfig, normalize_database_url, redact_url
from outbox.errors import ConfigurationError


def test_defaults_are_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUTBOX_KAFKA_CONFIG", raising=False)
    config = OutboxConfig().validate()
    assert config.cache_ttl < config.retention
    assert config.max_payload_bytes == 1_000_000  # librdkafka's message.max.bytes


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cache_ttl": 0}, "cache_ttl must be positive"),
        ({"cache_ttl": 10, "retention": 5}, "shorter than retention"),
        ({"cache_prefix": ""}, "cache_prefix"),
        ({"cache_prefix": "a{b}"}, "cache_prefix"),
        ({"max_payload_bytes": 0}, "max_payload_bytes"),
        ({"schema": "Bad-Name"}, "invalid schema name"),
        ({"permanent_errors": (ValueError, "nope")}, "exception classes"),
        ({"cache_socket_timeout": 0}, "cache_socket_timeout"),
        ({"pooler": "statement"}, "pooler must be None"),
        ({"pooler": "Transaction"}, "pooler must be None"),
    ],
)
def test_invalid_configs(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        OutboxConfig(**kwargs).validate()  # type: ignore[arg-type]


def test_retention_follows_the_rule_of_outbox_gc() -> None:
    # What outbox gc --older-than refuses, OutboxConfig.retention refuses, with the same limits.
    from outbox.admin import DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS, RetentionError, check_retention

    with pytest.raises(RetentionError, match="at least min_redelivery_window"):
        OutboxConfig(retention=2 * 86400.0).validate()
    with pytest.raises(RetentionError, match="redelivery window"):
        check_retention(2 * 86400.0, 86400.0, DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS)
    assert OutboxConfig().min_redelivery_window == DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS
    lowered = OutboxConfig(retention=2 * 86400.0, min_redelivery_window=86400.0 + 1).validate()
    assert lowered.retention == 2 * 86400.0


def test_durations_take_the_cli_forms() -> None:
    config = OutboxConfig(cache_ttl="12h", retention="1w1d", min_redelivery_window="7d").validate()
    assert (config.cache_ttl, config.retention) == (12 * 3600.0, 8 * 86400.0)
    assert config.min_redelivery_window == 7 * 86400.0
    with pytest.raises(ConfigurationError, match=r"invalid duration.*e\.g\. 7d"):
        OutboxConfig(retention="a week").validate()


def test_redact_url_hides_passwords() -> None:
    assert redact_url("postgresql://u:secret@h:5432/db") == "postgresql://u:***@h:5432/db"
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("postgresql://u@h/db") == "postgresql://u@h/db"


def test_database_urls_are_normalized_to_psycopg() -> None:
    assert normalize_database_url("postgres://u@h/d") == "postgresql+psycopg://u@h/d"
    assert normalize_database_url("postgresql://u@h/d") == "postgresql+psycopg://u@h/d"
    with pytest.raises(ConfigurationError, match="psycopg 3"):
        normalize_database_url("mysql://u@h/d")
    with pytest.raises(ConfigurationError) as info:
        normalize_database_url("garbage:pw")
    assert "pw" not in str(info.value)


def test_kafka_config_pairs() -> None:
    assert parse_kafka_config(["a=1", "b = two"], "c=3,d=4\ne=5") == {
        "c": "3",
        "d": "4",
        "e": "5",
        "a": "1",
        "b": "two",
    }
    assert parse_kafka_config(["a=1"], "a=0") == {"a": "1"}  # flags win
    with pytest.raises(ConfigurationError, match="KEY=VALUE"):
        parse_kafka_config(["novalue"])


def test_statements_quote_the_schema_and_carry_no_input() -> None:
    sql = statements("tenant_1")
    assert '"tenant_1"' in sql.idempotency_key_fail or "tenant_1." in sql.idempotency_key_fail
    final = idempotency_key_complete("tenant_1", 2)
    assert final.prepare.count("$") == 5 + 12  # key, result, the claim's token; 2 events
    assert "%(e1)s" in final.execute and "%(e1)s" in final.direct and "$" not in final.direct
    assert final.name != idempotency_key_complete(None, 2).name
    ordered = idempotency_key_complete("tenant_1", 2, 1)
    assert ordered.prepare.count("$") == 5 + 12 + 1 and "pg_advisory_xact_lock" in ordered.prepare
    assert "%(l0)s" in ordered.execute and ordered.name != final.name


def test_lock_ids_are_64_bit_and_distinct_per_scope() -> None:
    a, b = lock_id("s", "k"), lock_id("s2", "k")
    assert a != b and -(2**63) <= a < 2**63
    assert lock_id("a", "b\x00c") != lock_id("a\x00b", "c")


def test_numbers_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from outbox.config import env_float, env_int

    monkeypatch.delenv("OUTBOX_X", raising=False)
    assert env_int("OUTBOX_X", 7) == 7 and env_int("OUTBOX_X", None) is None
    monkeypatch.setenv("OUTBOX_X", "42")
    assert env_int("OUTBOX_X", 7) == 42 and env_float("OUTBOX_X", 1.0) == 42.0
    monkeypatch.setenv("OUTBOX_X", "4x")
    with pytest.raises(ConfigurationError, match=r"OUTBOX_X='4x' is not an integer"):
        env_int("OUTBOX_X", 7)
    with pytest.raises(ConfigurationError, match=r"OUTBOX_X='4x' is not a number"):
        env_float("OUTBOX_X", 1.0)


@given(
    st.one_of(st.text(), st.integers(), st.booleans(), st.binary(), st.floats()).filter(
        lambda value: value not in POOLERS
    )
)
def test_pooler_is_one_of_the_pooling_modes(value: object) -> None:
    """Anything but None, "session" or "transaction" is refused by validate(), before any
    connection exists."""
    with pytest.raises(ConfigurationError, match="pooler must be None"):
        OutboxConfig(pooler=value).validate()  # type: ignore[arg-type]


@given(
    st.one_of(
        st.integers(max_value=0),
        st.integers(min_value=1_000_001),
        st.booleans(),
        st.floats(),
        st.text(max_size=5),
        st.none(),
    )
)
def test_a_savepoint_chunk_that_is_not_an_integer_in_range_is_refused_by_name(
    chunk: object,
) -> None:
    with pytest.raises(ConfigurationError, match=r"^savepoint_chunk must be"):
        ConsumerConfig(
            topics=("t",), group="g", bootstrap_servers="127.0.0.1:9092", savepoint_chunk=chunk
        ).validate()  # type: ignore[arg-type]


@pytest.mark.parametrize("url", ["db.example.com:5432/app", "app:pw@db.example.com/app"])
def test_the_missing_scheme_hint_survives_redaction(url: str) -> None:
    from outbox._core.redact import redact_text
    from outbox._core.urls import check_database_url

    with pytest.raises(ConfigurationError) as caught:
        check_database_url(url)
    shown = redact_text(str(caught.value))  # what the commands print
    assert "does not start with a scheme" in shown
    assert shown.endswith("expected postgresql+psycopg://user:***@host:5432/dbname")
    assert "pw" not in shown
