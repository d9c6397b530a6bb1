"""The relay's per-batch decisions: the claim rule's filter, delivery rounds and settlement."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import given, strategies as st

from outbox._core.delivery import (
    ClaimedRow,
    deliver_in_rounds,
    delivery_rounds,
    drop_blocked,
    settle,
    split_claim,
)


@dataclass(frozen=True)
class Report:
    """A delivery report as the Kafka adapter gives one (``_kafka.producer.DeliveryReport``)."""

    error: str | None = None
    code: int | None = None
    permanent: bool = False


CONFIRMED = Report()
TIMEOUT = Report(error="_MSG_TIMED_OUT: Local: Message timed out", code=-192)
TOO_LARGE = Report(error="MSG_SIZE_TOO_LARGE", code=10, permanent=True)
NOT_SENT = Report(error="not sent: the relay stopped before sending this record")
UNSENDABLE = Report(error="row cannot be turned into a record: ValueError", permanent=True)


def _topics(keys: Sequence[object], topic: str = "t") -> list[str]:
    return [topic] * len(keys)


def _row(row_id: int, key: bytes | None, attempts: int = 0) -> ClaimedRow:
    return (row_id, attempts, "t", key, b"v", "{}", f"e-{row_id}".encode(), False)


def _skipped(row_id: int, key: bytes | None) -> ClaimedRow:
    return (row_id, 0, "", key, b"", "", b"", True)


# ------------------------------------------------------------------------------ examples


def test_a_batch_for_one_topic_is_one_round_however_hot_its_keys() -> None:
    keys = [b"a", b"b", b"a", None, b"a", b"b", None]
    assert delivery_rounds(keys, _topics(keys)) == [list(range(7))]
    assert delivery_rounds([b"hot"] * 5000, ["t"] * 5000) == [list(range(5000))]
    assert delivery_rounds([], []) == []


def test_a_key_moving_to_another_topic_waits_for_the_next_round() -> None:
    """Another topic is another partition: the producer keeps no order between them."""
    keys = [b"a", b"b", b"a", None, b"a", b"b", b"a"]
    topics = ["t", "t", "u", "u", "u", "t", "t"]
    assert delivery_rounds(keys, topics) == [[0, 1, 3, 5], [2, 4], [6]]


def test_claimed_rows_behind_a_skipped_row_of_their_key_wait() -> None:
    """Claim rule: a row locked elsewhere (skipped) holds back every later row of its key,
    not the earlier ones, not other keys, never key-less rows."""
    claimed = [_row(1, b"a"), _row(2, b"b"), _row(4, b"a"), _row(5, None), _row(6, b"b")]
    kept = drop_blocked(claimed, [(3, b"a"), (7, b"b")])
    assert [r[0] for r in kept] == [1, 2, 5, 6]
    assert drop_blocked(claimed, []) is claimed
    assert [r[0] for r in drop_blocked(claimed, [(0, b"b"), (3, b"b")])] == [1, 4, 5]


def test_split_claim_sorts_and_applies_the_claim_rule() -> None:
    fetched = [_row(4, b"a"), _row(1, b"a"), _skipped(3, b"a"), _row(2, b"b")]
    claimed, sendable = split_claim(fetched)
    assert [r[0] for r in claimed] == [1, 2, 4]
    assert [r[0] for r in sendable] == [1, 2]


def test_a_failed_row_stops_its_key_for_the_rest_of_the_batch() -> None:
    keys = [b"a", b"b", b"a", b"b", None, b"a"]
    topics = ["t", "t", "u", "t", "t", "t"]
    sent: list[list[int]] = []

    def send(todo: list[int]) -> list[Report | None]:
        sent.append(todo)
        return [TIMEOUT if i == 0 else CONFIRMED for i in todo]

    outcomes, count, gaps = deliver_in_rounds(keys, topics, send)
    assert sent == [[0, 1, 3, 4]]  # a's rows in the later rounds never go out
    assert count == 4 and gaps == 0
    assert outcomes == [TIMEOUT, CONFIRMED, None, CONFIRMED, CONFIRMED, None]


def test_rows_the_producer_did_not_send_stop_their_key() -> None:
    """``send`` gives ``None`` for records it held back after refusing an earlier one of their
    key: not sent, nothing to settle, and the key's later rounds are skipped too."""
    keys = [b"a", b"a", b"b", b"a"]
    topics = ["t", "t", "t", "u"]
    sent: list[list[int]] = []

    def send(todo: list[int]) -> list[Report | None]:
        sent.append(todo)
        return [TOO_LARGE, None, CONFIRMED][: len(todo)]

    outcomes, count, gaps = deliver_in_rounds(keys, topics, send)
    assert sent == [[0, 1, 2]] and count == 3 and gaps == 0
    assert outcomes == [TOO_LARGE, None, CONFIRMED, None]


def test_a_row_confirmed_behind_a_failed_row_of_its_key_is_reported_as_a_gap() -> None:
    keys = [b"a", b"a", b"a"]

    def send(todo: list[int]) -> list[Report | None]:
        return [CONFIRMED, TIMEOUT, CONFIRMED]

    outcomes, _count, gaps = deliver_in_rounds(keys, _topics(keys), send)
    assert gaps == 1 and outcomes == [CONFIRMED, TIMEOUT, CONFIRMED]


def test_an_unsendable_row_lets_earlier_rows_of_its_key_out_and_stops_later_ones() -> None:
    keys = [b"m", b"m", b"m", b"o"]
    sent: list[list[int]] = []

    def send(todo: list[int]) -> list[Report | None]:
        sent.append(todo)
        return [CONFIRMED] * len(todo)

    outcomes, count, _gaps = deliver_in_rounds(keys, _topics(keys), send, failed={1: UNSENDABLE})
    assert sent == [[0, 3]]
    assert count == 2
    assert outcomes == [CONFIRMED, UNSENDABLE, None, CONFIRMED]


def test_no_round_starts_once_stopping() -> None:
    keys = [b"a", b"a", b"a"]
    topics = ["t", "u", "t"]
    calls: list[list[int]] = []

    def send(todo: list[int]) -> list[Report | None]:
        calls.append(todo)
        return [CONFIRMED] * len(todo)

    outcomes, count, _gaps = deliver_in_rounds(keys, topics, send, stopping=lambda: len(calls) == 1)
    assert calls == [[0]] and count == 1 and outcomes == [CONFIRMED, None, None]


def test_confirmed_rows_are_deleted_and_failures_recorded() -> None:
    s = settle([1, 2, 3, 4], [0, 0, 9, 0], [CONFIRMED, TIMEOUT, TIMEOUT, None], max_attempts=10)
    assert s.delete == [1]
    assert s.fail_ids == [2, 3] and s.fail_park == [False, True]  # row 3 reached 10 attempts
    assert not s.outage


def test_permanent_error_parks_at_once() -> None:
    s = settle([1, 2], [0, 0], [TOO_LARGE, CONFIRMED], max_attempts=10)
    assert s.fail_ids == [1] and s.fail_park == [True] and s.delete == [2]


def test_outage_counts_no_attempts() -> None:
    """Nothing confirmed at all: the broker is down; rows must not creep towards parking."""
    s = settle([1, 2], [9, 9], [TIMEOUT, TIMEOUT], max_attempts=10)
    assert s.outage and s.fail_ids == [] and s.delete == []


def test_rows_not_sent_at_shutdown_are_left_alone() -> None:
    s = settle([1, 2], [0, 0], [CONFIRMED, NOT_SENT], max_attempts=3)
    assert s.delete == [1] and s.fail_ids == [] and not s.outage


# ------------------------------------------------------------------------------ properties

KEYS = st.one_of(st.none(), st.sampled_from([b"a", b"b", b"c", b"d"]))
TOPICS = st.sampled_from(["t", "t", "t", "u"])
REPORTS = st.sampled_from([CONFIRMED, CONFIRMED, CONFIRMED, TIMEOUT, TOO_LARGE])

Batch = tuple[list[bytes | None], list[str], dict[int, Report], list[Report]]


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    """Keys and topics of a claimed batch in id order, rows that cannot become records, and
    the reports the broker gives to the sends, in order."""
    keys = draw(st.lists(KEYS, max_size=30))
    topics = draw(st.lists(TOPICS, min_size=len(keys), max_size=len(keys)))
    unsendable = draw(st.sets(st.integers(0, max(0, len(keys) - 1)), max_size=3)) if keys else set()
    reports = draw(st.lists(REPORTS, min_size=len(keys), max_size=len(keys)))
    return keys, topics, dict.fromkeys(unsendable, UNSENDABLE), reports


def _deliver(batch: Batch) -> tuple[list[Report | None], list[int], int]:
    """Deliver with a fake producer that keeps the Kafka adapter's promise: within one send,
    once a record of a key failed, every later record of that key fails too (no gaps)."""
    keys, topics, failed, reports = batch
    order: list[int] = []
    script = iter(reports)

    def send(todo: list[int]) -> list[Report | None]:
        order.extend(todo)
        out: list[Report | None] = []
        failing: dict[bytes, Report] = {}
        for i in todo:
            report = next(script)
            key = keys[i]
            if key is not None and key in failing:
                report = failing[key]
            elif key is not None and report.error is not None:
                failing[key] = report
            out.append(report)
        return out

    outcomes, count, gaps = deliver_in_rounds(keys, topics, send, failed=failed)
    assert count == len(order)
    return outcomes, order, gaps


@given(st.lists(st.tuples(KEYS, TOPICS), max_size=40))
def test_rounds_partition_the_batch_keeping_each_keys_order(
    rows: list[tuple[bytes | None, str]],
) -> None:
    keys = [k for k, _ in rows]
    topics = [t for _, t in rows]
    rounds = delivery_rounds(keys, topics)
    assert sorted(i for r in rounds for i in r) == list(range(len(keys)))
    assert all(r == sorted(r) for r in rounds)
    depth = {i: n for n, r in enumerate(rounds) for i in r}
    for i in range(len(keys)):
        for j in range(i + 1, len(keys)):
            if keys[i] is not None and keys[i] == keys[j]:
                # Same topic: the same round or a later one; another topic: a later round.
                assert depth[i] <= depth[j] if topics[i] == topics[j] else depth[i] < depth[j]


@given(batches())
def test_a_failed_row_is_never_overtaken_by_a_later_row_of_its_key(batch: Batch) -> None:
    """docs/concepts.md I7 within a batch: a row goes out in a round after an earlier row of its key
    only once that row was confirmed; in the same round only for the same topic and after it; a
    failed, parked or unsendable row is never followed by a confirmed later row of its key; every
    row is sent at most once; rows without a key are never held back."""
    keys, topics, failed, _reports = batch
    outcomes, order, gaps = _deliver(batch)
    assert gaps == 0
    assert len(order) == len(set(order)) and not set(order) & set(failed)
    rounds = delivery_rounds(keys, topics)
    depth = {i: n for n, r in enumerate(rounds) for i in r}
    when = {i: n for n, i in enumerate(order)}
    for j in order:
        for i in range(j):
            if keys[i] is None or keys[i] != keys[j]:
                continue
            assert i in when and when[i] < when[j], f"row {j} went out before row {i}"
            if depth[i] < depth[j]:
                assert outcomes[i] is not None and outcomes[i].error is None
            else:
                assert topics[i] == topics[j]
    for j, report in enumerate(outcomes):
        if report is None or report.error is not None:
            continue
        for i in range(j):
            if keys[i] is not None and keys[i] == keys[j]:
                assert outcomes[i] is not None and outcomes[i].error is None, (
                    f"row {j} confirmed behind row {i}"
                )
    for i, key in enumerate(keys):
        if key is None and i not in failed:
            assert i in when


@given(batches(), st.integers(0, 12), st.integers(1, 10))
def test_settlement_deletes_only_confirmed_rows_and_never_parks_on_an_outage(
    batch: Batch, attempts: int, max_attempts: int
) -> None:
    keys = batch[0]
    outcomes, _, _ = _deliver(batch)
    ids = [10 + i for i in range(len(keys))]
    s = settle(ids, [attempts] * len(keys), outcomes, max_attempts)
    confirmed = [ids[i] for i, o in enumerate(outcomes) if o is not None and o.error is None]
    assert s.delete == confirmed
    assert not set(s.fail_ids) & set(s.delete)
    assert s.failed == sum(1 for o in outcomes if o is not None and o.error is not None)
    by_id = dict(zip(ids, outcomes, strict=True))
    for row_id, park in zip(s.fail_ids, s.fail_park, strict=True):
        report = by_id[row_id]
        assert report is not None and report.error is not None
        assert park == (report.permanent or attempts + 1 >= max_attempts)
    if s.outage:  # nothing got through: only permanent failures are written, nothing counted
        assert not s.delete
        assert all(getattr(by_id[i], "permanent", False) for i in s.fail_ids)


@given(
    st.lists(st.tuples(st.integers(1, 60), KEYS), max_size=30, unique_by=lambda t: t[0]),
    st.sets(st.integers(1, 60), max_size=10),
)
def test_no_claimed_row_passes_a_skipped_row_of_its_key(
    rows: list[tuple[int, bytes | None]], skipped_ids: set[int]
) -> None:
    claimed = sorted((_row(i, k) for i, k in rows if i not in skipped_ids), key=lambda r: r[0])
    skipped = [(i, k) for i, k in rows if i in skipped_ids]
    kept = drop_blocked(claimed, skipped)
    kept_ids = {r[0] for r in kept}
    for row in claimed:
        blocked = any(k is not None and k == row[3] and i < row[0] for i, k in skipped)
        assert (row[0] in kept_ids) == (not blocked)
