"""Pure input checks: what is refused, what passes, and that messages say why."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from outbox._core import codec as _codec, validate as _validate
from outbox.errors import (
    InvalidKeyError,
    InvalidTopicError,
    PayloadTooLargeError,
    SerializationError,
)

TOPIC_CHARS = st.sampled_from("abcXYZ019._-")


@given(st.text(min_size=1, max_size=255).filter(lambda s: not _validate._has_control(s)))
def test_any_printable_key_up_to_255_is_accepted(key: str) -> None:
    assert _validate.check_key(key) == key


@pytest.mark.parametrize("key", ["", "x" * 256, "tab\tkey", "nul\x00", 5, None, b"k"])
def test_bad_keys(key: object) -> None:
    with pytest.raises(InvalidKeyError):
        _validate.check_key(key)


def test_long_key_message_says_the_limit_and_what_to_do() -> None:
    with pytest.raises(InvalidKeyError, match=r"limit is 255.*hash"):
        _validate.check_key("x" * 300)


@given(
    st.text(alphabet=TOPIC_CHARS, min_size=1, max_size=249).filter(lambda t: t not in (".", ".."))
)
def test_legal_topics(topic: str) -> None:
    assert _validate.check_topic(topic) == topic


@pytest.mark.parametrize("topic", ["", ".", "..", "a b", "ü", "a/b", "t" * 250, None, b"t"])
def test_illegal_topics(topic: object) -> None:
    with pytest.raises(InvalidTopicError):
        _validate.check_topic(topic)


@pytest.mark.parametrize("scope", ["default", "payments", "billing.v2", "a:b/c-d_e"])
def test_good_scopes(scope: str) -> None:
    assert _validate.check_scope(scope) == scope


@pytest.mark.parametrize("scope", ["", "has space", "x" * 101, None, "semi;colon"])
def test_bad_scopes(scope: object) -> None:
    with pytest.raises(InvalidKeyError):
        _validate.check_scope(scope)


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text().filter(lambda s: "\x00" not in s),
    lambda children: (
        st.lists(children) | st.dictionaries(st.text().filter(lambda s: "\x00" not in s), children)
    ),
    max_leaves=20,
)


@given(JSON)
def test_json_values_round_trip(value: object) -> None:
    encoded, content_type = _validate.encode_value(value)
    if value is None:  # a tombstone: a null value, not the JSON document null
        assert (encoded, content_type) == (None, None)
    elif isinstance(value, str):  # text is sent as text, not as a JSON string
        assert (encoded, content_type) == (value.encode(), "text/plain; charset=utf-8")
    else:
        assert content_type == "application/json"
        assert encoded is not None and json.loads(encoded) == value


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), {"a": object()}, {1, 2}, {"s": "a\x00"}]
)
def test_unserializable_values(value: object) -> None:
    with pytest.raises(SerializationError):
        _validate.encode_value(value)


def test_bytes_and_text_values_keep_their_form() -> None:
    assert _validate.encode_value(b"\x00\x01") == (b"\x00\x01", "application/octet-stream")
    assert _validate.encode_value("héllo") == ("héllo".encode(), "text/plain; charset=utf-8")


def test_lone_surrogate_text_is_refused() -> None:
    with pytest.raises(SerializationError):
        _validate.encode_value("\udcff")


def test_size_counts_key_value_and_headers() -> None:
    # 36 bytes of record framing, 55 of the X-Idempotency-Key the relay adds, 1 + 98 of key and
    # value, and the header "a" with its two one-byte length varints.
    _validate.check_size(b"k", b"v" * 98, {"a": ""}, 36 + 55 + 99 + 3)
    with pytest.raises(PayloadTooLargeError, match="194 bytes"):
        _validate.check_size(b"k", b"v" * 98, {"a": b"b"}, 36 + 55 + 99 + 3)


@given(
    st.dictionaries(
        st.text(min_size=1).filter(lambda s: "\x00" not in s),
        st.binary() | st.text().filter(lambda s: "\x00" not in s),
    )
)
def test_headers_round_trip_through_storage(headers: dict[str, str | bytes]) -> None:
    checked = _validate.check_headers(headers)
    stored = json.loads(json.dumps(_codec.encode_headers(checked)))
    decoded = dict(_codec.decode_headers(stored))
    assert decoded == {k: v if isinstance(v, bytes) else v.encode() for k, v in headers.items()}


def test_content_type_is_not_overridden() -> None:
    headers: dict[str, str | bytes] = {"Content-Type": "application/avro"}
    assert _validate.with_content_type(headers, "application/json") == {
        "Content-Type": "application/avro"
    }


@given(st.binary(max_size=64), st.binary(min_size=16, max_size=16))
def test_key_hash_is_stable_and_31_bit(key: bytes, event_id: bytes) -> None:
    h = _codec.key_hash(key, event_id)
    assert 0 <= h < 2**31 and h == _codec.key_hash(key, b"other-event-id!!")


def test_lone_surrogate_key_is_refused() -> None:
    with pytest.raises(InvalidKeyError, match="UTF-8"):
        _validate.check_key("\udcff")
