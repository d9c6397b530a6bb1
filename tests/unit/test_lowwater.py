"""The relay's low-water mark (outbox._core.lowwater): where a claim may start."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from outbox._core.lowwater import Assumptions, Facts, LowWater, Verdict, verify

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


SEQ = "public.outbox_id_seq"


def facts(**changed: object) -> Facts:
    base: dict[str, object] = {
        "isolation": "read committed",
        "cache": 1,
        "increment": 1,
        "cycle": False,
        "readable": True,
        "drawn": 100,
        "filenode": 5,
        "backends": None,
    }
    return Facts(**{**base, **changed})  # type: ignore[arg-type]


def run(state: Assumptions, reading: Facts, fresh: bool = True) -> Verdict:
    return verify(state, reading, fresh=fresh, sequence=SEQ)


def test_the_mark_is_used_while_every_assumption_holds_and_nothing_is_logged() -> None:
    verdict = run(Assumptions(), facts())
    assert verdict.usable and not verdict.restart and verdict.message is None
    assert not verdict.state.watch


@pytest.mark.parametrize(
    ("changed", "code", "advice"),
    [
        ({"isolation": "repeatable read"}, "isolation", "default_transaction_isolation"),
        ({"isolation": "serializable"}, "isolation", "read committed"),
        ({"readable": False, "drawn": None}, "privilege", f"GRANT SELECT ON SEQUENCE {SEQ}"),
        ({"cache": 20}, "cache", f"ALTER SEQUENCE {SEQ} CACHE 1"),
        ({"increment": -1}, "increment", "INCREMENT -1"),
        ({"cycle": True}, "cycle", "NO CYCLE"),
        ({"cache": None, "increment": None, "cycle": None}, "no_sequence", SEQ),
    ],
)
def test_a_broken_assumption_turns_the_mark_off_with_one_line_until_it_holds_again(
    changed: dict[str, object], code: str, advice: str
) -> None:
    state = run(Assumptions(), facts()).state
    off = run(state, facts(**changed))
    assert not off.usable
    assert off.message is not None and f"reason={code}" in off.message and advice in off.message
    again = run(off.state, facts(**{"drawn": 110, **changed}))
    assert not again.usable and again.message is None  # said once
    back = run(again.state, facts(drawn=120))
    if code == "cache":
        # Back to CACHE 1: the backends connected now may hold cached values.
        assert not back.usable and back.state.watch
        back = run(back.state, facts(drawn=120, backends=frozenset()))
    assert back.usable and back.restart  # the mark starts from zero again
    assert back.message is not None and "event=low_water_on" in back.message
    assert run(back.state, facts(drawn=130)).message is None


def test_after_the_cache_goes_back_to_one_the_mark_waits_for_every_backend_then_connected() -> None:
    state = run(Assumptions(), facts()).state
    state = run(state, facts(cache=20, backends=frozenset({11, 12}))).state
    assert state.watch  # the next readings list the backends
    # Read inside a batch transaction (a claim ahead): its list of backends may be stale.
    ahead = run(state, facts(drawn=140, backends=frozenset({11})), fresh=False)
    assert not ahead.usable and ahead.message is None
    first = run(ahead.state, facts(drawn=150, backends=frozenset({11, 12, 13})))
    assert not first.usable and first.state.suspects == {11, 12, 13}
    assert first.message is not None and "reason=cached_values" in first.message
    assert "11, 12, 13" in first.message
    # A backend connecting afterwards cannot hold values cached by the old setting.
    later = run(first.state, facts(drawn=160, backends=frozenset({12, 14})))
    assert not later.usable and later.state.suspects == {12} and later.message is None
    # The cache goes up again before they left: the list is taken anew when it is back at 1.
    up = run(later.state, facts(cache=10, drawn=170, backends=frozenset({12, 14})))
    assert not up.usable and up.state.suspects is None
    assert up.message is not None and "reason=cache" in up.message
    down = run(up.state, facts(drawn=180, backends=frozenset({14, 15})))
    assert down.state.suspects == {14, 15} and not down.usable
    done = run(down.state, facts(drawn=190, backends=frozenset({16})))
    assert done.usable and done.restart and not done.state.watch


def test_settings_altered_between_two_claims_count_as_a_cache_until_those_backends_left() -> None:
    # CACHE 20 and back to 1 between two claims: the relay never reads the cache above 1, but
    # the sequence's row in pg_sequence was written by another transaction since.
    state = run(Assumptions(), facts(altered=700)).state
    changed = run(state, facts(drawn=110, altered=705))
    assert not changed.usable and changed.state.watch
    assert changed.message is not None and "reason=cache" in changed.message
    listed = run(changed.state, facts(drawn=120, altered=705, backends=frozenset({21})))
    assert not listed.usable and listed.state.suspects == {21}
    gone = run(listed.state, facts(drawn=130, altered=705, backends=frozenset({22})))
    assert gone.usable and gone.restart


@pytest.mark.parametrize(
    "moved", [{"drawn": 40}, {"filenode": 6, "drawn": 130}], ids=["setval", "restart"]
)
def test_a_sequence_that_moved_back_restarts_the_mark_from_zero(moved: dict[str, int]) -> None:
    state = run(Assumptions(), facts()).state
    verdict = run(state, facts(**moved))
    assert not verdict.usable and verdict.restart
    assert verdict.message is not None and "event=low_water_restart" in verdict.message
    after = run(verdict.state, facts(**{**moved, "drawn": moved["drawn"] + 5}))
    assert after.usable and not after.restart and after.message is None


@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "isolation": st.sampled_from(["read committed", "repeatable read"]),
                "cache": st.sampled_from([1, 1, 1, 20]),
                "readable": st.booleans(),
                "backends": st.one_of(st.none(), st.frozensets(st.integers(1, 6), max_size=4)),
                "fresh": st.booleans(),
            }
        ),
        max_size=25,
    )
)
def test_the_mark_is_never_used_while_a_backend_may_hold_a_cached_value(steps: list) -> None:
    # A model: while the cache is above 1 any backend may come to hold cached values; those
    # listed by the first reading that began its transaction after the cache went back to 1
    # are all that can, and each counts until a list no longer names it (a list read earlier in
    # the same transaction names every backend still connected, and maybe more).
    state = Assumptions()
    holders: set[int] | None = set()  # None: unknown backends may hold values
    for drawn, step in enumerate(steps, 1):
        fresh = step["fresh"]
        backends = step["backends"] if state.watch else None
        reading = facts(
            isolation=step["isolation"],
            cache=step["cache"],
            readable=step["readable"],
            drawn=drawn if step["readable"] else None,
            backends=backends,
        )
        verdict = run(state, reading, fresh=fresh)
        if step["cache"] != 1:
            holders = None  # any backend alive now, even one not listed, may cache values
        elif holders is None and fresh and backends is not None:
            holders = set(backends)
        elif holders and backends is not None:
            # A list read earlier in the transaction still holds every backend alive now.
            holders &= set(backends)
        if verdict.usable:
            assert holders == set()
            assert step["isolation"] == "read committed" and step["readable"]
        state = verdict.state
