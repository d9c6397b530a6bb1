"""The cache's entry format: signed, bound to its Redis key, its expiry and its database, and
read without ever raising on what Redis hands back."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from outbox._core.claim import STATUS_COMPLETED, STATUS_FAILED, StoredOutcome
from outbox._redis.entry import MAX_ENTRY_BYTES, decode_entry, derive_key, encode_entry

SYSTEM = 7_312_345_678_901_234_567
KEY = derive_key(b"s" * 32, 16384, 24576, SYSTEM, 1)
NOW = 1_900_000_000_000
REDIS_KEY = "outbox:4:shop:o-1"
DONE = StoredOutcome(STATUS_COMPLETED, "fp", '{"order":"o-1"}', None)
FAILED = StoredOutcome(STATUS_FAILED, None, None, "PermanentError: out of stock")


def entry(outcome: StoredOutcome = DONE, key: bytes = KEY, redis_key: str = REDIS_KEY) -> bytes:
    raw = encode_entry(outcome, key, redis_key, NOW + 60_000)
    assert raw is not None
    return raw


@pytest.mark.parametrize(
    "outcome", [DONE, FAILED, StoredOutcome(STATUS_COMPLETED, None, None, None)]
)
def test_an_entry_reads_back_as_written(outcome: StoredOutcome) -> None:
    raw = entry(outcome)
    assert decode_entry(raw, KEY, REDIS_KEY, NOW) == outcome
    assert decode_entry(raw.decode(), KEY, REDIS_KEY, NOW) == outcome  # decode_responses=True
    document = json.loads(raw)  # still plain JSON, the MAC last
    assert document["s"] == outcome.status and list(document)[-1] == "m"


def test_another_databases_key_another_redis_key_or_an_expired_entry_is_a_miss() -> None:
    raw = entry()
    assert decode_entry(raw, derive_key(b"t" * 32, 16384, 24576, SYSTEM, 1), REDIS_KEY, NOW) is None
    assert decode_entry(raw, derive_key(b"s" * 32, 16385, 24576, SYSTEM, 1), REDIS_KEY, NOW) is None
    assert decode_entry(raw, derive_key(b"s" * 32, 16384, 24577, SYSTEM, 1), REDIS_KEY, NOW) is None
    # Another cluster (a dump restored elsewhere), another timeline (a promoted standby).
    other_cluster = derive_key(b"s" * 32, 16384, 24576, SYSTEM + 1, 1)
    assert decode_entry(raw, other_cluster, REDIS_KEY, NOW) is None
    promoted = derive_key(b"s" * 32, 16384, 24576, SYSTEM, 2)
    assert decode_entry(raw, promoted, REDIS_KEY, NOW) is None
    assert decode_entry(raw, KEY, "outbox:4:shop:o-2", NOW) is None
    assert decode_entry(raw, KEY, REDIS_KEY, NOW + 60_000) is None


def test_a_well_formed_but_unsigned_or_edited_entry_is_a_miss() -> None:
    legacy = json.dumps({"s": "completed", "f": None, "r": '{"order":"forged"}'}).encode()
    assert decode_entry(legacy, KEY, REDIS_KEY, NOW) is None
    raw = entry()
    edited = raw.replace(b"o-1", b"o-9")
    assert decode_entry(edited, KEY, REDIS_KEY, NOW) is None
    later = raw.replace(str(NOW + 60_000).encode(), str(NOW + 10**9).encode())
    assert decode_entry(later, KEY, REDIS_KEY, NOW) is None


@given(st.integers(0, len(entry()) - 1), st.integers(1, 255))
def test_any_flipped_byte_is_a_miss(position: int, flip: int) -> None:
    raw = bytearray(entry())
    raw[position] ^= flip
    assert decode_entry(bytes(raw), KEY, REDIS_KEY, NOW) is None


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@given(
    st.one_of(
        st.binary(max_size=4096),
        st.text(max_size=512),
        st.integers(1, 200_000).map(_nested),
        st.builds(lambda d: b'{"s":"completed","r":' + _nested(d) + b"}", st.integers(1, 50_000)),
        st.none(),
        st.integers(),
        st.lists(st.binary(max_size=8), max_size=3),
    )
)
def test_anything_redis_may_hold_is_a_miss_never_an_exception(raw: object) -> None:
    assert decode_entry(raw, KEY, REDIS_KEY, NOW) is None


def test_oversized_entries_are_neither_written_nor_read() -> None:
    big = StoredOutcome(STATUS_COMPLETED, None, json.dumps("x" * MAX_ENTRY_BYTES), None)
    assert encode_entry(big, KEY, REDIS_KEY, NOW) is None
    assert decode_entry(b"x" * (MAX_ENTRY_BYTES + 1), KEY, REDIS_KEY, NOW) is None


def test_entries_are_signed_per_key_and_identity() -> None:
    assert derive_key(b"s" * 32, 1, 2, 3, 4) != derive_key(b"s" * 32, 1, None, 3, 4)
    assert derive_key(b"s" * 32, 1, 2, 3, 4) != derive_key(b"s" * 32, 1, 2, 34, 1)
    assert entry(key=derive_key(b"s" * 32, 1, 2, 3, 4)) != entry()
    assert len(KEY) == 32
