"""The consumer groups' lag the console shows: committed offsets against partition ends."""

from __future__ import annotations

from outbox._core.lag import TopicLag, topic_lags


def test_lag_is_the_sum_over_partitions_of_end_minus_committed() -> None:
    committed = {("orders", 0): 3, ("orders", 1): 5, ("audit", 0): 7}
    ends = {("orders", 0): 5, ("orders", 1): 9, ("audit", 0): 7}
    assert topic_lags("g", committed, ends) == [
        TopicLag("g", "audit", partitions=1, committed=7, end=7, lag=0, unknown=0),
        TopicLag("g", "orders", partitions=2, committed=8, end=14, lag=6, unknown=0),
    ]


def test_a_partition_without_a_commit_or_an_end_is_unknown_not_a_guess() -> None:
    committed = {("t", 0): 2, ("t", 1): None, ("t", 2): -1001, ("t", 3): 4}
    ends = {("t", 0): 10, ("t", 1): 10, ("t", 2): 10}  # partition 3's end was not given
    (lag,) = topic_lags("g", committed, ends)
    assert (lag.partitions, lag.committed, lag.end, lag.lag, lag.unknown) == (4, 2, 10, 8, 3)


def test_an_end_below_the_commit_is_no_lag_not_a_negative_one() -> None:
    (lag,) = topic_lags("g", {("t", 0): 9}, {("t", 0): 4})
    assert lag.lag == 0


def test_partitions_committed_past_their_end_are_counted() -> None:
    (lag,) = topic_lags("g", {("t", 0): 9, ("t", 1): 2, ("t", 2): 5}, {("t", 0): 4, ("t", 1): 6})
    assert (lag.ahead, lag.unknown, lag.lag) == (1, 1, 4)
