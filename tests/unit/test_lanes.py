"""Lane arithmetic: fair shares, convergence of many relays, ownership read from pg_locks."""

from __future__ import annotations

import random

import pytest

from outbox._core import lanes
from outbox._core.durations import format_ranges


def test_lane_of_is_key_hash_modulo_lanes() -> None:
    assert [lanes.lane_of(h, 8) for h in (0, 7, 8, 2**31 - 1)] == [0, 7, 0, (2**31 - 1) % 8]


@pytest.mark.parametrize(("total", "relays", "share"), [(32, 1, 32), (32, 3, 11), (8, 16, 1)])
def test_fair_share_covers_every_lane(total: int, relays: int, share: int) -> None:
    assert lanes.fair_share(total, relays) == share
    assert share * relays >= total


def test_namespaces_differ_per_schema_and_kind() -> None:
    keys = {
        lanes.namespace(schema, kind)
        for schema in (None, "billing")
        for kind in (lanes.KIND_MEMBER, lanes.KIND_LANES, lanes.KIND_LANE, lanes.KIND_ENGINE)
    }
    assert len(keys) == 8
    assert all(0 <= k < 2**31 for k in keys)
    assert lanes.namespace(None, "lane") == lanes.namespace("public", "lane")


def _simulate(total: int, owned: dict[int, set[int]], rounds: int, rng: random.Random) -> None:
    """Relays rebalance one after another, in random order, like independent processes."""
    for _ in range(rounds):
        pids = list(owned)
        rng.shuffle(pids)
        for pid in pids:
            others = {lane for p, held in owned.items() if p != pid for lane in held}
            plan = lanes.plan_rebalance(total, len(owned), owned[pid], others, seed=pid)
            assert not set(plan.acquire) & others, "planned to take a lane someone holds"
            owned[pid] -= set(plan.release)
            owned[pid] |= set(plan.acquire)


@pytest.mark.parametrize("seed", range(20))
def test_relays_converge_to_disjoint_fair_shares(seed: int) -> None:
    rng = random.Random(seed)
    total = rng.choice([1, 7, 32, 64])
    owned: dict[int, set[int]] = {rng.randrange(1, 10**6): set() for _ in range(rng.randint(1, 6))}
    _simulate(total, owned, 4, rng)
    # Relays join and die; the survivors converge again within a few rebalances.
    for _ in range(3):
        if len(owned) > 1 and rng.random() < 0.5:
            del owned[rng.choice(list(owned))]
        else:
            owned[rng.randrange(1, 10**6)] = set()
        _simulate(total, owned, 4, rng)
        held = [lane for lanes_ in owned.values() for lane in lanes_]
        assert sorted(held) == list(range(total)), "a lane is unowned or owned twice"
        share = lanes.fair_share(total, len(owned))
        assert all(len(h) <= share for h in owned.values())


def test_surplus_given_back_is_stable() -> None:
    plan = lanes.plan_rebalance(8, 2, set(range(8)), set(), seed=3)
    assert plan.target == 4 and plan.acquire == ()
    kept = set(range(8)) - set(plan.release)
    assert len(kept) == 4
    again = lanes.plan_rebalance(8, 2, kept, set(plan.release), seed=3)
    assert again.release == () and again.acquire == ()


def test_ownership_from_locks_groups_lanes_per_relay() -> None:
    member = lanes.namespace("s", lanes.KIND_MEMBER)
    lane = lanes.namespace("s", lanes.KIND_LANE)
    foreign = lanes.namespace("other", lanes.KIND_LANE)
    rows = [
        lanes.LockRow(10, member, 10),
        lanes.LockRow(10, lane, 3),
        lanes.LockRow(10, lane, 1),
        lanes.LockRow(11, member, 11),  # registered, no lane yet
        lanes.LockRow(12, foreign, 5),  # another schema's relay
        lanes.LockRow(10, lanes.namespace("s", lanes.KIND_LANES), 32),
    ]
    assert lanes.ownership_from_locks(rows, "s") == {10: (1, 3), 11: ()}
    assert lanes.configured_lane_counts(rows, "s") == {32}


def test_lane_lists_read_as_ranges() -> None:
    assert format_ranges([0, 1, 2, 3, 7, 9, 10]) == "0-3,7,9-10"
    assert format_ranges((10, 9, 3, 3)) == "3,9-10"
    assert format_ranges([5]) == "5"
    assert format_ranges([]) == "-"


def test_engines_of_relays_count_a_member_without_an_engine_lock_as_a_claim_relay() -> None:
    ns = {k: lanes.namespace(None, k) for k in ("member", "engine", "lane")}
    rows = [
        lanes.LockRow(1, ns["member"], 1),
        lanes.LockRow(1, ns["engine"], lanes.ENGINE_CODES["window"]),
        lanes.LockRow(1, ns["lane"], 0),
        lanes.LockRow(2, ns["member"], 2),  # an earlier release: no engine lock
        lanes.LockRow(2, ns["lane"], 1),
        lanes.LockRow(3, ns["engine"], lanes.ENGINE_CODES["claim"]),  # starting: no lane
        lanes.LockRow(4, lanes.namespace("other", "engine"), lanes.ENGINE_CODES["claim"]),
    ]
    assert lanes.engines_of_relays(rows, None) == {1: "window", 2: "claim", 3: "claim"}
    assert lanes.other_engines(rows, None, "window", 1, serving=False) == {2: "claim", 3: "claim"}
    assert lanes.other_engines(rows, None, "window", 1, serving=True) == {2: "claim"}
    assert lanes.other_engines(rows, None, "claim", 2, serving=False) == {1: "window"}
    assert lanes.other_engines(rows, None, "claim", 3, serving=True) == {1: "window"}
