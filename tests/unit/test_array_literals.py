"""Array parameters of the batch statements, written as PostgreSQL array literals."""

from __future__ import annotations

import uuid

from hypothesis import given, strategies as st

from outbox._pg.literals import _array_text


def reference(values: list[object]) -> bytes:
    """Each element by the array input rules: NULL bare, strings double-quoted with a backslash
    before every quote and backslash, bytea in hex."""
    parts = []
    for value in values:
        if value is None:
            parts.append("NULL")
        elif isinstance(value, bytes):
            parts.append('"\\\\x' + value.hex() + '"')
        elif isinstance(value, str):
            parts.append('"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"')
        else:
            parts.append(str(value))
    return ("{" + ",".join(parts) + "}").encode()


def same(got: bytes, want: bytes) -> bool:
    # The fast path writes NULL as JSON does; the server reads either.
    return got.replace(b"null", b"NULL") == want.replace(b"null", b"NULL")


text = st.text(st.characters(exclude_categories=["Cs"]), max_size=20)


@given(st.lists(st.one_of(st.none(), text), max_size=20))
def test_strings_and_nulls(values: list[str | None]) -> None:
    assert same(_array_text(values), reference(values))


@given(st.lists(st.one_of(st.none(), st.binary(max_size=8)), max_size=10))
def test_bytes(values: list[bytes | None]) -> None:
    assert _array_text(values) == reference(values)


def test_numbers_uuids_and_the_empty_array() -> None:
    ids = [uuid.UUID(int=1), uuid.UUID(int=2)]
    assert _array_text([1, -2, 2**62]) == b"{1,-2,4611686018427387904}"
    assert _array_text(ids) == ("{" + ",".join(map(str, ids)) + "}").encode()
    assert _array_text([1, None]) == b"{1,NULL}"
    assert _array_text([]) == b"{}"
    assert _array_text(['say "NULL"', "NULL"]) == b'{"say \\"NULL\\"","NULL"}'
