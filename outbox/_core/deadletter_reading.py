"""Dead letters read back: grouped by failure, and the headers of a redriven message.

A group is the exception type and its message with the parts that vary from one message to the
next (numbers, UUIDs, hex strings) replaced by placeholders, so that a thousand
``KeyError: 'order-17'`` ... ``'order-9004'`` dead letters are one line with a count. A redrive
sends the original key, value and headers (minus the ``outbox.dlq.*`` ones) back to the original
topic with :data:`REDRIVE_HEADER` counting how often that message has been redriven.

A dead letter is *handled* once an operator discarded or redrove it: Kafka keeps it, the listings
leave it out (a group only counts how many of its letters were handled).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from outbox._core.deadletter import HEADER_PREFIX, DeadLetterInfo

REDRIVE_HEADER = "outbox.redrive-count"

HANDLED_DISCARDED = "discarded"
HANDLED_REDRIVEN = "redriven"
HANDLED_HOWS = (HANDLED_DISCARDED, HANDLED_REDRIVEN)
MAX_HANDLED_BY_LENGTH = 200

_GROUP_ID = re.compile(r"[0-9a-f]{12}")

_VARYING = [
    (re.compile(r"\b[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}\b"), "<uuid>"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b|\b[0-9a-fA-F]{16,}\b"), "<hex>"),
    (re.compile(r"\d+(?:\.\d+)?"), "<n>"),
]  # fmt: skip


def normalize_error(error: str) -> str:
    """The error text with its varying parts replaced by placeholders."""
    for pattern, placeholder in _VARYING:
        error = pattern.sub(placeholder, error)
    return error


def group_id(topic: str, error_type: str, normalized: str) -> str:
    """A short, stable id of a failure group (for ``--group`` and links)."""
    digest = hashlib.sha256(f"{topic}\x00{error_type}\x00{normalized}".encode()).hexdigest()
    return digest[:12]


@dataclass(frozen=True)
class Letter:
    """A record read from a dead-letter topic."""

    partition: int
    offset: int
    timestamp_ms: int | None
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    info: DeadLetterInfo | None  # None: not written by the consumer runner

    @property
    def ref(self) -> str:
        """``partition:offset`` in its dead-letter topic."""
        return f"{self.partition}:{self.offset}"


@dataclass
class Group:
    """Dead letters that failed the same way."""

    id: str
    topic: str  # the original topic
    error_type: str
    error: str  # normalized
    reason: str
    letters: list[Letter] = field(default_factory=list)
    handled: int = 0  # letters of this group already handled (left out of ``letters`` unless asked)

    @property
    def count(self) -> int:
        return len(self.letters)

    @property
    def first_seen_ms(self) -> int | None:
        stamps = [x.timestamp_ms for x in self.letters if x.timestamp_ms is not None]
        return min(stamps) if stamps else None

    @property
    def last_seen_ms(self) -> int | None:
        stamps = [x.timestamp_ms for x in self.letters if x.timestamp_ms is not None]
        return max(stamps) if stamps else None


def group_letters(letters: Iterable[Letter]) -> list[Group]:
    """Letters grouped by original topic, exception type and normalized error; biggest first.
    Records without the runner's headers form one group of their own."""
    groups: dict[str, Group] = {}
    for letter in letters:
        info = letter.info
        if info is None:
            topic, error_type, error, reason = "?", "?", "not a dead letter of outbox-kit", "?"
        else:
            topic, error_type, reason = info.topic, info.error_type, info.reason
            error = normalize_error(info.error)
        gid = group_id(topic, error_type, error)
        if gid not in groups:
            groups[gid] = Group(gid, topic, error_type, error, reason)
        groups[gid].letters.append(letter)
    return sorted(groups.values(), key=lambda g: (-g.count, g.id))


def redrive_headers(headers: Sequence[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """The original headers without ``outbox.dlq.*``, with the redrive count raised by one."""
    count = 0
    kept: list[tuple[str, bytes]] = []
    for name, value in headers:
        if name == REDRIVE_HEADER:
            with contextlib.suppress(UnicodeDecodeError, ValueError):
                count = max(count, int(value.decode("ascii")))
            continue
        if not name.startswith(HEADER_PREFIX):
            kept.append((name, value))
    kept.append((REDRIVE_HEADER, str(count + 1).encode("ascii")))
    return kept


def parse_ref(text: str) -> tuple[int, int]:
    """``partition:offset`` as two numbers; ``ValueError`` with a message otherwise."""
    partition, sep, offset = text.partition(":")
    if (
        not sep
        or not (partition + offset).isascii()
        or not partition.isdigit()
        or not offset.isdigit()
    ):
        raise ValueError(f"{text[:40]!r} is not PARTITION:OFFSET, e.g. 0:42")
    return int(partition), int(offset)


MAX_CURSOR_PARTITIONS = 10_000
MAX_PARTITION = 2**31 - 1
MAX_OFFSET = 2**63 - 1


def format_cursor(positions: Mapping[int, int]) -> str:
    """Where to go on reading a dead-letter topic: ``PARTITION:OFFSET,...`` (for ``--from``
    and the console's ``from`` parameter)."""
    return ",".join(f"{p}:{o}" for p, o in sorted(positions.items()))


def parse_cursor(text: str) -> dict[int, int]:
    """The positions of :func:`format_cursor`; ``ValueError`` with a message otherwise."""
    if not isinstance(text, str) or not text or len(text) > MAX_CURSOR_PARTITIONS * 32:
        raise ValueError("expected PARTITION:OFFSET[,PARTITION:OFFSET...], e.g. 0:1200,1:0")
    positions: dict[int, int] = {}
    for part in text.split(","):
        partition, offset = parse_ref(part)
        if partition > MAX_PARTITION or offset > MAX_OFFSET:
            raise ValueError(f"{part[:40]!r}: partition or offset out of range")
        if partition in positions:
            raise ValueError(f"partition {partition} appears twice")
        positions[partition] = offset
    if len(positions) > MAX_CURSOR_PARTITIONS:
        raise ValueError(f"{len(positions)} partitions: at most {MAX_CURSOR_PARTITIONS}")
    return positions


def describe_stop(stopped: Mapping[int, int], limit: int) -> str:
    """What a page that stopped reading says: after how many, where, and how to go on."""
    places = ", ".join(f"partition {p} from offset {o}" for p, o in sorted(stopped.items()))
    return f"reading stopped after {limit} dead letter(s) still to handle; more may wait ({places})"


def check_group_id(text: str) -> str:
    """A group id as :func:`group_id` makes them (12 hex digits); ``ValueError`` otherwise."""
    if not isinstance(text, str) or not _GROUP_ID.fullmatch(text):
        shown = repr(text[:40]) if isinstance(text, str) else type(text).__name__
        raise ValueError(f"{shown} is not a group id (12 hex digits, from `outbox dlq list`)")
    return text


def check_how(how: str) -> str:
    """How a dead letter was handled: ``discarded`` or ``redriven``."""
    if how not in HANDLED_HOWS:
        raise ValueError(
            f"{str(how)[:40]!r} is not a way to handle a dead letter: discarded or redriven"
        )
    return how


def group_unhandled(
    letters: Iterable[Letter],
    handled: Collection[tuple[int, int]],
    *,
    include_handled: bool = False,
) -> tuple[list[Group], int]:
    """Letters grouped as :func:`group_letters` does, each group counting its handled letters;
    without ``include_handled`` these are left out (and groups left empty dropped). Returns the
    groups, biggest first, and how many letters were handled."""
    groups = group_letters(letters)
    total = 0
    kept: list[Group] = []
    for group in groups:
        done = [x for x in group.letters if (x.partition, x.offset) in handled]
        group.handled = len(done)
        total += len(done)
        if not include_handled:
            group.letters = [x for x in group.letters if (x.partition, x.offset) not in handled]
        if group.letters:
            kept.append(group)
    return sorted(kept, key=lambda g: (-g.count, g.id)), total


def choose_letters(
    groups: Iterable[Group], group_ids: Collection[str], refs: Collection[tuple[int, int]]
) -> tuple[list[Letter], int]:
    """The letters of the groups named by ``group_ids`` and those at ``refs``; and how many of
    the named groups and refs matched no letter."""
    chosen: dict[tuple[int, int], Letter] = {}
    seen_groups: set[str] = set()
    seen_refs: set[tuple[int, int]] = set()
    for group in groups:
        for letter in group.letters:
            place = (letter.partition, letter.offset)
            if group.id in group_ids:
                seen_groups.add(group.id)
                chosen[place] = letter
            if place in refs:
                seen_refs.add(place)
                chosen[place] = letter
    missing = len(set(group_ids) - seen_groups) + len(set(refs) - seen_refs)
    return [chosen[place] for place in sorted(chosen)], missing
