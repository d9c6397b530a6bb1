"""The relay's decisions about one batch, written once and tested without services.

Invariant (docs/concepts.md I7): a failed or parked row is never overtaken by a later row of its
key. Two rules keep it:

* the second half of the **claim rule**: a row is sent only when no earlier row of its key is
  left in the table outside this relay's claim (the first half is the claim query);
* the **round rule**: within a batch a key's rows for one topic go out together, in id order,
  in one round; a row for another topic than the key's previous row waits for the next round
  (after Kafka confirmed the rows before it), and a row that failed stops its key for the rest
  of the batch.

Why rows of one key and topic may share a round: they go to one partition (the partitioner maps a
key to a partition), and the idempotent producer writes a partition's records in the order they
were produced, retrying without reordering. What it does not promise by itself is that a
record that *fails* is not followed by a later one that succeeds (a gap); the Kafka adapter
closes that door (a gap-less producer, records refused on the spot stop their key at once, and a
delivery deadline that fails every outstanding record together). So the barrier between rounds
is needed only where order could cross partitions -- the same key in two topics -- and a failure
costs its key the rest of the batch, while a hot key costs nothing extra: its rows travel in one
round however many there are. Settlement then deletes confirmed rows, records failures, parks
rows after bounded attempts, and calls a batch in which nothing got through an outage.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, TypeVar


class DeliveryFate(Protocol):
    """What the decisions need to know of a record's delivery report (the Kafka adapter's
    :class:`outbox._kafka.producer.DeliveryReport` is one): ``error`` is ``None`` when Kafka
    confirmed the record."""

    @property
    def error(self) -> str | None: ...

    @property
    def code(self) -> int | None: ...

    @property
    def permanent(self) -> bool: ...


R = TypeVar("R", bound=DeliveryFate)

# A row as the claim returns it (a plain tuple: the relay handles thousands per batch):
# (id, attempts, topic, key, value, headers JSON text, event id as ASCII bytes, skipped).
# Skipped rows (see outbox._pg.relay.OUTBOX_CLAIM_BATCH) carry only id and key.
ClaimedRow = tuple[int, int, str, bytes | None, bytes | None, str, bytes, bool]
ID: Final = 0
ATTEMPTS: Final = 1
TOPIC: Final = 2
KEY: Final = 3
VALUE: Final = 4
HEADERS: Final = 5
EVENT_ID: Final = 6
SKIPPED: Final = 7
_row_id = operator.itemgetter(ID)


def split_claim(fetched: Sequence[ClaimedRow]) -> tuple[list[ClaimedRow], list[ClaimedRow]]:
    """The rows a claim locked, in id order, and those of them that may be sent now (see
    :func:`drop_blocked`)."""
    claimed = [r for r in fetched if not r[SKIPPED]]
    # The claim walks the primary key, so this sort only confirms the order (O(n)).
    claimed.sort(key=_row_id)
    skipped = [(r[ID], r[KEY]) for r in fetched if r[SKIPPED]]
    return claimed, drop_blocked(claimed, skipped)


def drop_blocked(
    claimed: list[ClaimedRow], skipped: Sequence[tuple[int, bytes | None]]
) -> list[ClaimedRow]:
    """Claim rule, second half: drop every claimed row that has an earlier row of its key among
    the ``skipped`` rows (locked by another transaction, or behind a parked row).

    ``skipped`` is empty unless another relay holds rows of these lanes, so the usual cost is
    nothing.
    """
    if not skipped:
        return claimed
    first: dict[bytes, int] = {}
    for row_id, key in skipped:
        if key is not None and row_id < first.get(key, row_id + 1):
            first[key] = row_id
    kept: list[ClaimedRow] = []
    for row in claimed:
        key = row[KEY]
        if key is None or first.get(key, row[ID] + 1) > row[ID]:
            kept.append(row)
    return kept


def delivery_rounds(keys: Sequence[bytes | None], topics: Sequence[str]) -> list[list[int]]:
    """Split a claimed batch (in id order) into rounds of row indexes, in id order each.

    A key's row joins the round of the key's previous row when both are for the same topic
    (one partition: the producer keeps their order), else the next round. Key-less rows have no
    order to keep and all go in round 0. Most batches are one round.
    """
    count = len(keys)
    if count == 0:
        return []
    if len(set(topics)) == 1:
        return [list(range(count))]
    rounds: list[list[int]] = [[]]
    last: dict[bytes, tuple[str, int]] = {}
    for index, key in enumerate(keys):
        depth = 0
        if key is not None:
            topic = topics[index]
            previous = last.get(key)
            if previous is not None:
                depth = previous[1] if previous[0] == topic else previous[1] + 1
            last[key] = (topic, depth)
        if depth == len(rounds):
            rounds.append([])
        rounds[depth].append(index)
    return rounds


def single_round(keys: Sequence[bytes | None], topics: Sequence[str]) -> bool:
    """Whether the batch goes out in one round (:func:`delivery_rounds`)."""
    return len(set(topics)) <= 1 or len(delivery_rounds(keys, topics)) <= 1


def deliver_in_rounds(
    keys: Sequence[bytes | None],
    topics: Sequence[str],
    send: Callable[[list[int]], Sequence[R | None]],
    *,
    failed: Mapping[int, R] | None = None,
    stopping: Callable[[], bool] | None = None,
) -> tuple[list[R | None], int, int]:
    """Send a batch round by round; returns each row's report (``None``: not sent), how many
    rows were handed to ``send``, and how many rows Kafka confirmed although an earlier row of
    their key had failed in the same round (*gaps*: the Kafka adapter is built so that this
    never happens; the relay reports any it sees).

    ``send`` produces the rows at the given indexes, in that order, and returns one report per
    row, in order; ``None`` for a row it did not produce because an earlier row of its key was
    refused on the spot. ``failed`` holds rows that failed before any send (they cannot become
    records): each stops its key from its own position on, so the earlier rows of its key still
    go out. A row whose report is not a confirmation stops its key for the rest of the batch.
    When ``stopping()`` turns true no further round starts: what was confirmed so far is
    settled, the rest stays.
    """
    fates: list[R | None] = [None] * len(keys)
    failed = failed or {}
    for index, report in failed.items():
        fates[index] = report
    stopped: set[bytes] = set()
    sent = 0
    gaps = 0
    for round_ in delivery_rounds(keys, topics):
        if stopping is not None and stopping():
            break
        todo = round_
        if stopped or failed:
            todo = []
            for i in round_:
                key = keys[i]
                if i in failed:
                    if key is not None:
                        stopped.add(key)  # its earlier rows are before it in this round
                elif key is None or key not in stopped:
                    todo.append(i)
            if not todo:
                continue
        reports = send(todo)
        sent += len(todo)
        trouble = False
        for i, got in zip(todo, reports, strict=True):
            fates[i] = got
            if got is None or got.error is not None:
                trouble = True
        if trouble:
            gaps += _stop_failed_keys(todo, keys, fates, stopped)
    return fates, sent, gaps


def _stop_failed_keys(
    todo: list[int],
    keys: Sequence[bytes | None],
    fates: Sequence[DeliveryFate | None],
    stopped: set[bytes],
) -> int:
    """After a round with failures: stop every key that had a row fail or not go out; count
    the rows confirmed behind such a row of their key."""
    failing: set[bytes] = set()
    gaps = 0
    for i in todo:
        key = keys[i]
        if key is None:
            continue
        report = fates[i]
        if report is None or report.error is not None:
            failing.add(key)
        elif key in failing:
            gaps += 1
    stopped |= failing
    return gaps


@dataclass(frozen=True)
class Settlement:
    """What to write back for a batch: confirmed rows to delete and failed rows to update."""

    delete: list[int]
    fail_ids: list[int]
    fail_errors: list[str]
    fail_park: list[bool]
    outage: bool
    failed: int = 0  # rows whose report is not a confirmation

    @property
    def parked(self) -> int:
        return sum(self.fail_park)


def settle(
    ids: Sequence[int],
    attempts: Sequence[int],
    fates: Sequence[DeliveryFate | None],
    max_attempts: int,
) -> Settlement:
    """Decide each row's fate from its delivery report (``None``: not sent in this batch).

    * confirmed -> deleted;
    * permanent error -> parked at once;
    * retriable error -> one more attempt recorded, parked when ``max_attempts`` is reached --
      but only if Kafka confirmed some other record of the batch. When nothing at all got
      through, the broker is the problem, not the rows: attempts are not counted (an outage
      must never park the whole outbox) and the batch is an *outage* (the caller backs off).
    """
    delete: list[int] = []
    failures: list[tuple[int, int, DeliveryFate]] = []
    for row_id, tries, fate in zip(ids, attempts, fates, strict=True):
        if fate is None:
            continue
        if fate.error is None:
            delete.append(row_id)
        else:
            failures.append((row_id, tries, fate))
    fail_ids: list[int] = []
    fail_errors: list[str] = []
    fail_park: list[bool] = []
    any_retriable = False
    for row_id, tries, fate in failures:
        if fate.permanent:
            fail_ids.append(row_id)
            fail_errors.append(fate.error or "")
            fail_park.append(True)
        elif fate.code is not None:
            any_retriable = True
            if delete:
                fail_ids.append(row_id)
                fail_errors.append(fate.error or "")
                fail_park.append(tries + 1 >= max_attempts)
    return Settlement(
        delete,
        fail_ids,
        fail_errors,
        fail_park,
        outage=any_retriable and not delete,
        failed=len(failures),
    )
