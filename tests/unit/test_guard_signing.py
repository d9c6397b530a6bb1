"""The guard's signed outcomes: bound to their Redis key, status, fingerprint, expiry and value;
anything else is unreadable (``GuardUnavailable``), never a replay."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from outbox._core.guard import GuardConfig, Replay, decode_claim, sign_outcome
from outbox.errors import ConfigurationError, GuardUnavailable, PreviouslyFailed

KEY = GuardConfig(secret="s" * 32).validate().signing_key
assert KEY is not None
REDIS_KEY = "outbox-guard:{8:payments:k1}"
NOW = 1_900_000_000_000


def _claim(stored: str, fingerprint: str = "", kind: str = "done", key: bytes = KEY) -> object:
    return decode_claim([kind, stored, fingerprint], "payments", "k1", None, REDIS_KEY, key, NOW)


def test_a_signed_outcome_reads_back() -> None:
    stored = sign_outcome(KEY, REDIS_KEY, "C", "fp", '{"charged": 10}', NOW + 1000)
    assert _claim(stored, "fp") == Replay({"charged": 10})
    failed = sign_outcome(KEY, REDIS_KEY, "F", "", "PermanentError: declined", NOW + 1000)
    with pytest.raises(PreviouslyFailed, match="declined"):
        _claim(failed, kind="failed")


@pytest.mark.parametrize(
    ("redis_key", "status", "fingerprint", "expires", "why"),
    [
        ("outbox-guard:{8:payments:k2}", "C", "fp", NOW + 1000, "does not match"),  # moved
        (REDIS_KEY, "F", "fp", NOW + 1000, "does not match"),  # a failure read as a result
        (REDIS_KEY, "C", "other", NOW + 1000, "does not match"),  # another claim's record
        (REDIS_KEY, "C", "fp", NOW, "past its expiry"),  # kept alive (PERSIST)
    ],
)
def test_an_outcome_signed_for_something_else_is_unreadable(
    redis_key: str, status: str, fingerprint: str, expires: int, why: str
) -> None:
    stored = sign_outcome(KEY, redis_key, status, fingerprint, '{"charged": 10}', expires)
    with pytest.raises(GuardUnavailable, match=why):
        _claim(stored, "fp")


@given(st.text(max_size=80))
def test_anything_unsigned_is_unreadable_never_a_replay(stored: str) -> None:
    with pytest.raises(GuardUnavailable):
        _claim(stored)


def test_another_secret_cannot_read_them_and_a_short_secret_is_refused() -> None:
    stored = sign_outcome(KEY, REDIS_KEY, "C", "", "{}", NOW + 1000)
    other = GuardConfig(secret=b"t" * 32).signing_key
    assert other is not None
    with pytest.raises(GuardUnavailable):
        _claim(stored, key=other)
    with pytest.raises(ConfigurationError, match="at least 16 bytes"):
        GuardConfig(secret="short").validate()
    assert "s" * 32 not in repr(GuardConfig(secret="s" * 32))
