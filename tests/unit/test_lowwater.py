"""The relay's low-water mark (outbox._core.lowwater): where a claim may start."""

from __future__ import annotations

from hypothesis import given, strategies as st

from outbox._core.lowwater import LowWater

LANES = frozenset(range(4))


def test_first_claim_starts_at_the_first_live_row_or_past_the_last_drawn_id() -> None:
    mark = LowWater().for_lanes(LANES)
    assert mark.advance(drawn=100, writers=[], first_live=40).low == 40
    assert mark.advance(drawn=100, writers=[], first_live=None).low == 101


def test_a_writer_seen_at_the_first_claim_holds_the_mark_where_it_was() -> None:
    mark = LowWater().for_lanes(LANES).advance(drawn=100, writers=["3/7"], first_live=None)
    assert mark.low == 0
    # Still writing at the next claim: it may hold any id the first claim could not rule out.
    assert mark.advance(drawn=200, writers=["3/7"], first_live=None).low == 0
    # Gone (committed or rolled back): every id up to the last drawn one is settled.
    assert mark.advance(drawn=200, writers=[], first_live=None).low == 201


def test_a_writer_first_seen_later_holds_ids_above_the_previous_claims_last_id() -> None:
    mark = LowWater().for_lanes(LANES).advance(drawn=100, writers=[], first_live=None)
    mark = mark.advance(drawn=180, writers=["4/9"], first_live=None)
    assert mark.low == 101
    # It keeps that bound while it lasts, however far the sequence moves on.
    mark = mark.advance(drawn=900, writers=["4/9", "5/1"], first_live=None)
    assert mark.low == 101
    mark = mark.advance(drawn=950, writers=["5/1"], first_live=None)
    assert mark.low == 181  # 5/1 was first seen at the claim that read 180


def test_a_live_row_below_every_bound_holds_the_mark() -> None:
    mark = LowWater().for_lanes(LANES).advance(drawn=100, writers=[], first_live=None)
    assert mark.advance(drawn=300, writers=[], first_live=150).low == 150


def test_new_lanes_start_from_zero() -> None:
    mark = LowWater().for_lanes(LANES).advance(drawn=100, writers=[], first_live=None)
    assert mark.for_lanes(LANES) is mark
    moved = mark.for_lanes(LANES | {4})
    assert moved.low == 0 and moved.drawn == 100


@given(
    st.lists(
        st.tuples(
            st.integers(0, 50),  # ids drawn since the previous claim
            st.sets(st.integers(0, 5), max_size=3),  # writers (by number) alive at the claim
            st.one_of(st.none(), st.integers(0, 300)),
        ),
        max_size=20,
    )
)
def test_the_mark_never_passes_an_id_a_live_writer_may_hold(steps: list) -> None:
    # A model: writer w holds the ids drawn while it was seen alive, plus those drawn just
    # before it was first seen (since the previous claim). The mark must stay at or below the
    # lowest of them while w is alive, and never move back.
    mark = LowWater().for_lanes(LANES)
    drawn = 0
    first_drawn: dict[int, int] = {}
    previous = 0
    for more, alive, first_live in steps:
        start = drawn
        drawn += more
        for w in list(first_drawn):
            if w not in alive:
                del first_drawn[w]
        for w in alive:
            first_drawn.setdefault(w, start + 1)
        live = None if first_live is None else max(first_live, mark.low)
        mark = mark.advance(drawn, [f"1/{w}" for w in alive], live)
        assert mark.low >= previous
        for lowest in first_drawn.values():
            assert mark.low <= lowest
        if live is not None:
            assert mark.low <= live
        assert mark.low <= drawn + 1
        previous = mark.low
