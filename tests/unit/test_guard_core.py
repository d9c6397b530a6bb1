"""The guard's pure decisions: settings, key layout, reading script answers (no services)."""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any

import pytest
from hypothesis import example, given, settings, strategies as st

from outbox._core import guard as core
from outbox.errors import (
    ConfigurationError,
    GuardUnavailable,
    InvalidKeyError,
    KeyInProgress,
    KeyReuseError,
    OutboxError,
    PreviouslyFailed,
)
from outbox.guard import AsyncRedisGuard, RedisGuard
from outbox.guard._heartbeat import AsyncHeartbeat, Heartbeat
from tests.fixtures.guard import (
    bad_fingerprints,
    bad_keys,
    bad_scopes,
    bad_seconds,
    not_a_number,
)

RKEY = "outbox-guard:{7:default:k}"

# ------------------------------------------------------------------------------ settings


@given(field=st.sampled_from(["lease", "completed_ttl", "failed_ttl"]), value=bad_seconds)
def test_bad_durations_are_configuration_errors(field: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=field):
        core.GuardConfig(**{field: value}).validate()  # type: ignore[arg-type]


@given(policy=st.one_of(not_a_number, st.text(max_size=20)))
def test_only_two_policies(policy: object) -> None:
    if policy in core.POLICIES:
        core.GuardConfig(on_redis_error=policy).validate()  # type: ignore[arg-type]
    else:
        with pytest.raises(ConfigurationError, match="on_redis_error"):
            core.GuardConfig(on_redis_error=policy).validate()  # type: ignore[arg-type]


@given(
    prefix=st.one_of(
        not_a_number.filter(lambda v: not isinstance(v, str)),
        st.just(""),
        st.text(min_size=65, max_size=80, alphabet="ab"),
        st.text(min_size=1, max_size=20).filter(lambda s: any(c in s for c in "{} \n\x00é/")),
    )
)
@example(prefix="outbox-guard\n")  # a final newline: what a `$`-anchored match lets through
def test_bad_prefixes(prefix: object) -> None:
    with pytest.raises(ConfigurationError, match="prefix"):
        core.GuardConfig(prefix=prefix).validate()  # type: ignore[arg-type]


def test_defaults_and_derived_values() -> None:
    s = core.GuardConfig().validate()
    assert (s.lease, s.on_redis_error, s.renew) == (30.0, "closed", False)
    s = core.GuardConfig(lease=1.5, completed_ttl=10, failed_ttl=20.5).validate()
    assert (s.lease_ms, s.completed_ttl_ms, s.failed_ttl_ms, s.keep_ms) == (
        1500,
        10000,
        20500,
        20500,
    )
    assert s.renew_interval == 0.5
    with pytest.raises(ConfigurationError, match="renew"):
        core.GuardConfig(renew="yes").validate()  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", [RedisGuard, AsyncRedisGuard])
def test_guards_refuse_bad_settings_and_clients_before_connecting(cls: Any) -> None:
    # Port 1 is closed: any connection attempt would fail differently (or hang).
    url = "redis://127.0.0.1:1/0"
    with pytest.raises(ConfigurationError, match="lease"):
        cls(url, lease=math.nan)
    with pytest.raises(ConfigurationError, match="on_redis_error"):
        cls(url, on_redis_error="ajar")
    with pytest.raises(ConfigurationError, match="cluster"):
        cls(url, cluster="yes")
    with pytest.raises(ConfigurationError, match="invalid Redis URL 'http://u:\\*\\*\\*@h/'"):
        cls("http://u:secret@h/")
    with pytest.raises(ConfigurationError, match="database 0"):
        cls("redis://h:1/3", cluster=True)
    with pytest.raises(ConfigurationError, match="RedisGuard needs"):
        cls(object())


# ------------------------------------------------------------------------------ key layout


def test_record_key_has_one_hash_tag_per_scope_and_key() -> None:
    key = core.record_key("p", "orders", "42")
    assert key == "p:{6:orders:42}"
    tag = key[key.index("{") + 1 : key.index("}")]
    assert tag == "6:orders:42"


valid_scope = st.from_regex(r"[A-Za-z0-9._:/-]{1,20}", fullmatch=True)
valid_key = st.text(min_size=1, max_size=30).filter(lambda k: k.isprintable())


@given(a=st.tuples(valid_scope, valid_key), b=st.tuples(valid_scope, valid_key))
def test_record_keys_of_different_claims_differ(a: tuple[str, str], b: tuple[str, str]) -> None:
    if a != b:
        assert core.record_key("p", *a) != core.record_key("p", *b)


def test_tokens_are_unique() -> None:
    assert len({core.new_token() for _ in range(1000)}) == 1000


def test_error_text_is_capped() -> None:
    assert core.error_text(ValueError("x")) == "ValueError: x"
    assert len(core.error_text(ValueError("x" * 10_000))) == core.MAX_ERROR_TEXT


# ------------------------------------------------------------------------------ verdicts


def decode(reply: object, fingerprint: str | None = None) -> object:
    return core.decode_claim(reply, "default", "k", fingerprint, RKEY)


def test_claim_answers() -> None:
    assert decode([b"new", 3, 0]) == core.Owned(3, False)
    assert decode(["new", 4, 1]) == core.Owned(4, True)  # decode_responses=True clients
    assert decode([b"done", b'{"a":[1]}', b""]) == core.Replay({"a": [1]})
    assert decode([b"done", b"null", b"fp"], "fp") == core.Replay(None)
    with pytest.raises(KeyInProgress):
        decode([b"busy", 1500])
    with pytest.raises(PreviouslyFailed, match="declined") as info:
        decode([b"failed", b"PermanentError: declined", b""])
    assert info.value.error == "PermanentError: declined"
    with pytest.raises(KeyReuseError):
        decode([b"done", b"1", b"fp-a"], "fp-b")
    with pytest.raises(KeyReuseError):
        decode([b"failed", b"e", b"fp-a"], "fp-b")
    with pytest.raises(GuardUnavailable, match=r"holds a string, not a hash.*DEL"):
        decode([b"corrupt", b"holds a string, not a hash"])


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": ',  # truncated
        b"not json",
        b"\xff\xfe",  # not UTF-8
        b"[" * 100_000 + b"]" * 100_000,  # nested deeper than the decoder goes
        b"",
    ],
)
def test_unreadable_results_are_guard_unavailable(raw: bytes) -> None:
    with pytest.raises(GuardUnavailable, match=r"not JSON|not UTF-8"):
        decode([b"done", raw, b""])


replies = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(),
        st.binary(max_size=20),
        st.text(max_size=20),
        st.sampled_from([b"new", b"busy", b"done", b"failed", b"corrupt", b"ok", b"lost"]),
    ),
    lambda children: st.lists(children, max_size=4),
    max_leaves=8,
)


@given(reply=replies, fingerprint=st.one_of(st.none(), st.text(min_size=1, max_size=3)))
def test_any_claim_answer_is_a_verdict_or_an_outbox_error(
    reply: object, fingerprint: str | None
) -> None:
    try:
        verdict = decode(reply, fingerprint)
    except OutboxError:
        return
    assert isinstance(verdict, core.Owned | core.Replay)


@given(reply=replies)
def test_any_transition_answer_is_a_transition_or_guard_unavailable(reply: object) -> None:
    try:
        answer = core.decode_transition(reply, "default", "k", RKEY)
    except GuardUnavailable:
        return
    assert isinstance(answer, core.Transition)


def test_transition_answers() -> None:
    assert core.decode_transition([b"ok", 2], "s", "k", RKEY) == core.Transition(True, 2)
    assert core.decode_transition([b"lost", 0], "s", "k", RKEY) == core.Transition(False, 0)
    with pytest.raises(GuardUnavailable, match="has no valid fence"):
        core.decode_transition([b"corrupt", b"has no valid fence"], "s", "k", RKEY)


# ------------------------------------------------------------------------------ decorator


def test_guard_arguments_key() -> None:
    def handler(claim: object, order_id: str, amount: int = 1) -> None: ...

    key_of = core.guard_arguments_key(handler, "order_id", is_async=False)
    assert key_of("o-1") == "o-1"
    assert key_of(amount=2, order_id="o-2") == "o-2"
    by_callable = core.guard_arguments_key(
        handler, lambda order_id, amount=1: f"x{order_id}", False
    )
    assert by_callable("1") == "x1"
    with pytest.raises(ConfigurationError, match="no parameter 'claim'"):
        core.guard_arguments_key(handler, "claim", is_async=False)  # the claim is not the caller's
    with pytest.raises(ConfigurationError, match="first parameter"):
        core.guard_arguments_key(lambda: None, "k", is_async=False)
    with pytest.raises(ConfigurationError, match=r"a plain function needs RedisGuard\.idempotent"):
        core.guard_arguments_key(handler, "order_id", is_async=True)
    with pytest.raises(ConfigurationError, match="no parameter 3"):
        core.guard_arguments_key(handler, 3, is_async=False)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ input


@settings(max_examples=200)
@given(
    which=st.sampled_from(["key", "scope", "fingerprint"]),
    key=bad_keys,
    scope=bad_scopes,
    fingerprint=bad_fingerprints,
)
def test_bad_claims_are_refused_without_connecting(
    which: str, key: object, scope: object, fingerprint: object
) -> None:
    guard = RedisGuard("redis://127.0.0.1:1/0")  # nothing listens: I/O would not be refused
    args: dict[str, Any] = {"key": "ok", "scope": "default", "fingerprint": None}
    args[which] = {"key": key, "scope": scope, "fingerprint": fingerprint}[which]
    with pytest.raises(InvalidKeyError):
        guard.claim(**args)
    with pytest.raises(InvalidKeyError):
        AsyncRedisGuard("redis://127.0.0.1:1/0").claim(**args)


# ------------------------------------------------------------------------------ heartbeat


def test_heartbeat_stops_when_told_or_when_the_beat_says_so() -> None:
    beats: list[int] = []
    third = threading.Event()

    def beat() -> bool:
        beats.append(1)
        if len(beats) == 3:
            third.set()
            return False
        return True

    heartbeat = Heartbeat(0.001, beat, "test")
    heartbeat.start()
    assert third.wait(10)
    heartbeat.stop()
    assert len(beats) == 3
    idle = Heartbeat(60, beat, "idle")
    idle.start()
    idle.stop()  # returns at once, without a beat
    assert len(beats) == 3


def test_async_heartbeat_stops_with_the_body() -> None:
    async def run() -> int:
        beats = 0
        enough = asyncio.Event()

        async def beat() -> bool:
            nonlocal beats
            beats += 1
            if beats == 3:
                enough.set()
            return True

        heartbeat = AsyncHeartbeat(0.001, beat, "test")
        heartbeat.start()
        await enough.wait()
        await heartbeat.stop()
        after = beats
        await asyncio.sleep(0.01)
        assert beats == after
        return beats

    assert asyncio.run(run()) >= 3
