"""Consumer groups' lag as the broker reports it: committed offsets against partition ends.

Invariant: a partition without a committed offset, or whose end the broker did not give, adds
nothing to a lag; it is counted as unknown, so a number on a page is never a guess.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from outbox._core.offsets import PartitionId


@dataclass(frozen=True)
class TopicLag:
    """One group's position in one topic, summed over the topic's partitions it committed in."""

    group: str
    topic: str
    partitions: int
    committed: int
    end: int
    lag: int
    unknown: int
    """Partitions with no committed offset or no end offset: not in the sums."""
    ahead: int = 0
    """Partitions whose committed offset is past their end: the log is shorter than what the
    group read (the topic was deleted and created again, or the broker lost records it had
    acknowledged). The group's next fetch there is out of range and starts where its
    ``auto.offset.reset`` says."""


@dataclass(frozen=True)
class GroupLags:
    """What the broker said about its consumer groups, or why it said nothing."""

    lags: tuple[TopicLag, ...] = ()
    groups: tuple[str, ...] = ()
    omitted: int = 0
    """Groups past the first ones by name, left out to keep the reading short."""
    error: str | None = None
    """Set when the broker did not answer or does not support an API the reading needs."""


def topic_lags(
    group: str, committed: Mapping[PartitionId, int | None], ends: Mapping[PartitionId, int | None]
) -> list[TopicLag]:
    """Per topic of ``committed``: the sums of committed and end offsets and the lag (each
    partition's ``end - committed``, never below zero), by topic name."""
    by_topic: dict[str, list[PartitionId]] = {}
    for tp in committed:
        by_topic.setdefault(tp[0], []).append(tp)
    out = []
    for topic in sorted(by_topic):
        done = end_sum = lag = unknown = ahead = 0
        for tp in by_topic[topic]:
            offset, end = committed[tp], ends.get(tp)
            if offset is None or offset < 0 or end is None or end < 0:
                unknown += 1
                continue
            done += offset
            end_sum += end
            lag += max(0, end - offset)
            ahead += offset > end
        out.append(TopicLag(group, topic, len(by_topic[topic]), done, end_sum, lag, unknown, ahead))
    return out
