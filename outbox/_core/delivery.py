"""The relay's decisions about one batch, written once and tested without services.

* :func:`split_claim` and :func:`drop_blocked` -- the second half of the **claim rule**: a row
  is sent only when no earlier row of its key is left in the table outside this relay's claim
  (the first half is the claim query, :mod:`outbox._pg.relay`).
* :func:`delivery_rounds` and :func:`deliver_in_rounds` -- the **round rule**: within a batch
  the ``n``-th row of a key is produced only after Kafka confirmed its ``n-1``-th row, and a row
  that failed stops its key for the rest of the batch.
* :func:`settle` -- what to write back: confirmed rows are deleted, failures recorded, rows
  parked after bounded attempts; a batch in which nothing got through is an outage.

Together they keep I7: a failed or parked row is never overtaken by a later row of its key.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, TypeVar


class DeliveryReport(Protocol):
    """What the decisions need to know of a record's delivery report (the Kafka adapter's
    ``Outcome`` is one): ``error`` is ``None`` when Kafka confirmed the record."""

    @property
    def error(self) -> str | None: ...

    @property
    def code(self) -> int | None: ...

    @property
    def permanent(self) -> bool: ...


R = TypeVar("R", bound=DeliveryReport)

# A row as the claim returns it (a plain tuple: the relay handles thousands per batch):
# (id, attempts, topic, key, value, headers JSON text, event id as ASCII bytes, skipped).
# Skipped rows (see outbox._pg.relay.OUTBOX_CLAIM_BATCH) carry only id and key.
ClaimedRow = tuple[int, int, str, bytes | None, bytes, str, bytes, bool]
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


def delivery_rounds(keys: Sequence[bytes | None]) -> list[list[int]]:
    """Split a claimed batch (in id order) into rounds of row indexes.

    Round ``r`` holds the ``r``-th row of every key; key-less rows have no order to keep and all
    go in round 0. Within a round no key appears twice, so a round can be produced at once.
    """
    rounds: list[list[int]] = []
    seen: dict[bytes, int] = {}
    for index, key in enumerate(keys):
        depth = 0
        if key is not None:
            depth = seen.get(key, 0)
            seen[key] = depth + 1
        if depth == len(rounds):
            rounds.append([])
        rounds[depth].append(index)
    return rounds


def deliver_in_rounds(
    keys: Sequence[bytes | None],
    send: Callable[[list[int]], Sequence[R]],
    *,
    failed: Mapping[int, R] | None = None,
    stopping: Callable[[], bool] | None = None,
) -> tuple[list[R | None], int]:
    """Send a batch round by round; returns each row's report (``None``: not sent) and how many
    rows were handed to ``send``.

    ``send`` produces the rows at the given indexes and returns one report per row, in order.
    ``failed`` holds rows that failed before any send (they cannot become records): each stops
    its key from its own round on, so the earlier rows of its key still go out. A row whose
    report is not a confirmation stops its key for the rest of the batch. When ``stopping()``
    turns true no further round starts: what was confirmed so far is settled, the rest stays.
    """
    outcomes: list[R | None] = [None] * len(keys)
    failed = failed or {}
    for index, report in failed.items():
        outcomes[index] = report
    stopped: set[bytes] = set()
    sent = 0
    for round_ in delivery_rounds(keys):
        if stopping is not None and stopping():
            break
        todo = round_
        if failed:
            for i in round_:
                key = keys[i]
                if i in failed and key is not None:
                    stopped.add(key)  # its earlier rows went in earlier rounds
        if stopped or failed:
            todo = [
                i
                for i in round_
                if outcomes[i] is None and (keys[i] is None or keys[i] not in stopped)
            ]
            if not todo:
                continue
        reports = send(todo)
        sent += len(todo)
        for i, report in zip(todo, reports, strict=True):
            outcomes[i] = report
            key = keys[i]
            if report.error is not None and key is not None:
                stopped.add(key)
    return outcomes, sent


@dataclass(frozen=True)
class Settlement:
    """What to write back for a batch: confirmed rows to delete and failed rows to update."""

    delete: list[int]
    fail_ids: list[int]
    fail_errors: list[str]
    fail_park: list[bool]
    outage: bool
    failed: int = 0  # rows with an outcome that is not a confirmation

    @property
    def parked(self) -> int:
        return sum(self.fail_park)


def settle(
    ids: Sequence[int],
    attempts: Sequence[int],
    outcomes: Sequence[DeliveryReport | None],
    max_attempts: int,
) -> Settlement:
    """Decide each row's fate from its delivery outcome (``None``: not sent in this batch).

    * confirmed -> deleted;
    * permanent error -> parked at once;
    * retriable error -> one more attempt recorded, parked when ``max_attempts`` is reached --
      but only if Kafka confirmed some other record of the batch. When nothing at all got
      through, the broker is the problem, not the rows: attempts are not counted (an outage
      must never park the whole outbox) and the batch is an *outage* (the caller backs off).
    """
    delete: list[int] = []
    failures: list[tuple[int, int, DeliveryReport]] = []
    for row_id, tries, outcome in zip(ids, attempts, outcomes, strict=True):
        if outcome is None:
            continue
        if outcome.error is None:
            delete.append(row_id)
        else:
            failures.append((row_id, tries, outcome))
    fail_ids: list[int] = []
    fail_errors: list[str] = []
    fail_park: list[bool] = []
    any_retriable = False
    for row_id, tries, outcome in failures:
        if outcome.permanent:
            fail_ids.append(row_id)
            fail_errors.append(outcome.error or "")
            fail_park.append(True)
        elif outcome.code is not None:
            any_retriable = True
            if delete:
                fail_ids.append(row_id)
                fail_errors.append(outcome.error or "")
                fail_park.append(tries + 1 >= max_attempts)
    return Settlement(
        delete,
        fail_ids,
        fail_errors,
        fail_park,
        outage=any_retriable and not delete,
        failed=len(failures),
    )
