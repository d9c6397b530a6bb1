"""Handled dead letters in ``outbox.admin`` against real PostgreSQL and the broker: marked at the
database's clock, first record kept, left out of the listing and counted, marked "redriven" once
the broker confirmed a redrive; bad input refused with nothing written."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given, settings, strategies as st

from outbox import admin
from outbox.errors import ConfigurationError, ValidationError
from outbox.schema import tables
from tests.fixtures.console import write_dead_letters
from tests.fixtures.kafka import read_to_end


def _rows(engine: sa.Engine) -> list[Any]:
    t = tables(None).dlq_handled
    with engine.connect() as conn:
        return list(conn.execute(sa.select(t).order_by(t.c.partition, t.c.offset)))


def test_a_mark_is_stamped_by_the_database_and_the_first_one_is_kept(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        now = conn.execute(sa.select(sa.func.now())).scalar_one()
        marked = admin.mark_handled(
            conn, "orders.dlq", [(0, 4), (1, 2), (0, 4)], "discarded", by="cli ann@host"
        )
    assert marked == 2  # the repeated ref once
    with engine.begin() as conn:
        assert admin.mark_handled(conn, "orders.dlq", [(0, 4)], "redriven", by="other") == 0
    rows = _rows(engine)
    assert [(r.partition, r.offset, r.how, r.handled_by) for r in rows] == [
        (0, 4, "discarded", "cli ann@host"),
        (1, 2, "discarded", "cli ann@host"),
    ]
    assert all(r.handled_at == now for r in rows)  # the transaction's clock, not the client's
    with engine.connect() as conn:
        assert admin.read_handled(conn, "orders.dlq") == {(0, 4): "discarded", (1, 2): "discarded"}
        assert admin.read_handled(conn, "payments.dlq") == {}


def test_marking_writes_nothing_until_the_caller_commits(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        admin.mark_handled(conn, "orders.dlq", [(0, 1)], "discarded")
        conn.rollback()
    assert _rows(engine) == []


BAD_REFS = st.one_of(
    st.tuples(st.integers(max_value=-1), st.integers(min_value=0)),
    st.tuples(st.integers(min_value=0), st.integers(max_value=-1)),
    st.tuples(st.integers(min_value=2**31), st.integers(min_value=0)),
    st.tuples(st.integers(min_value=0), st.integers(min_value=2**63)),
    st.tuples(st.text(max_size=5), st.integers(min_value=0)),
    st.tuples(st.floats(), st.booleans()),
    st.tuples(st.integers(0, 9), st.integers(0, 9), st.integers(0, 9)),
    st.text(max_size=4),
)


def test_bad_refs_ways_topics_and_names_are_refused_with_nothing_written(
    engine: sa.Engine,
) -> None:
    @settings(max_examples=60, deadline=None)
    @given(
        refs=st.lists(BAD_REFS, min_size=1, max_size=3),
        good=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 99)), max_size=3),
    )
    def bad_refs(refs: list[Any], good: list[tuple[int, int]]) -> None:
        with engine.begin() as conn, pytest.raises(ConfigurationError):
            admin.mark_handled(conn, "orders.dlq", [*good, *refs], "discarded")

    @settings(max_examples=40, deadline=None)
    @given(
        how=st.text(max_size=12).filter(lambda x: x not in ("discarded", "redriven")),
        topic=st.one_of(st.just("orders.dlq"), st.text(max_size=260)),
        by=st.one_of(st.none(), st.text(min_size=201), st.sampled_from(["a\nb", "\x00"])),
    )
    def bad_words(how: str, topic: str, by: str | None) -> None:
        with engine.begin() as conn, pytest.raises((ConfigurationError, ValidationError)):
            admin.mark_handled(conn, topic, [(0, 1)], how, by=by)
        with engine.begin() as conn, pytest.raises((ConfigurationError, ValidationError)):
            admin.discard(conn, "orders.dlq", [], by="x" * 201)

    bad_refs()
    bad_words()
    assert _rows(engine) == []


def test_handled_letters_leave_the_listing_and_a_redrive_marks_them(
    engine: sa.Engine, kafka_bootstrap: str
) -> None:
    topic = f"orders-{uuid.uuid4().hex[:8]}"
    dead = write_dead_letters(
        kafka_bootstrap,
        topic,
        [
            ("o-1", KeyError("'o-1' not in stock")),
            ("o-2", KeyError("'o-2' not in stock")),
            ("o-3", ValueError("price -4 is negative")),
        ],
    )
    with engine.connect() as conn:
        before = admin.read_dead_letters(conn, kafka_bootstrap, dead)
    assert [(g.error_type, g.count, g.handled) for g in before.groups] == [
        ("KeyError", 2, 0),
        ("ValueError", 1, 0),
    ]
    stock, price = before.groups
    with engine.begin() as conn:
        assert admin.discard(conn, dead, price.letters, by="test") == 1
    with engine.connect() as conn:
        after = admin.read_dead_letters(conn, kafka_bootstrap, dead)
        everything = admin.read_dead_letters(conn, kafka_bootstrap, dead, include_handled=True)
    assert [g.id for g in after.groups] == [stock.id] and after.handled == 1
    assert [(g.id, g.count, g.handled) for g in everything.groups] == [
        (stock.id, 2, 0),
        (price.id, 1, 1),
    ]

    with engine.connect() as conn:
        assert admin.redrive(kafka_bootstrap, stock.letters, connection=conn, dlq_topic=dead) == 2
        conn.commit()
    records = read_to_end(kafka_bootstrap, topic, at_least=2)
    assert sorted(r.key() for r in records) == [b"o-1", b"o-2"]
    with engine.connect() as conn:
        final = admin.read_dead_letters(conn, kafka_bootstrap, dead)
        assert final.groups == [] and final.handled == 3
        assert sorted(admin.read_handled(conn, dead).values()) == [
            "discarded",
            "redriven",
            "redriven",
        ]


def test_a_redrive_the_broker_does_not_confirm_marks_nothing(
    engine: sa.Engine, kafka_bootstrap: str
) -> None:
    topic = f"orders-{uuid.uuid4().hex[:8]}"
    dead = write_dead_letters(kafka_bootstrap, topic, [("o-1", KeyError("'o-1'"))])
    with engine.connect() as conn:
        letters = admin.read_dead_letters(conn, kafka_bootstrap, dead).groups[0].letters
        # A record over the size limit is refused: the redrive fails, nothing is marked.
        big = [
            type(x)(x.partition, x.offset, x.timestamp_ms, x.key, b"x" * 3000, x.headers, x.info)
            for x in letters
        ]
        with pytest.raises(Exception, match=r"too large|not confirmed"):
            admin.redrive(
                kafka_bootstrap,
                big,
                kafka_config={"message.max.bytes": "2000"},
                connection=conn,
                dlq_topic=dead,
            )
        conn.commit()
    assert _rows(engine) == []
