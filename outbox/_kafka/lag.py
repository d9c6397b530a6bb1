"""Consumer groups' committed offsets and their topics' end offsets, read with an AdminClient.

Invariant: the reading is bounded by one deadline (a slow broker costs the caller at most
``timeout`` seconds) and never raises for what the broker says: an error, a timeout or an API
the broker does not support comes back as :attr:`GroupLags.error`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec  # type: ignore[attr-defined]

from outbox._core.lag import GroupLags, TopicLag, topic_lags
from outbox._core.offsets import PartitionId
from outbox._core.redact import redact_text
from outbox._kafka.config import CONSUMER_ONLY, CONSUMER_ONLY_PREFIXES

MAX_GROUPS = 100


def _admin_config(bootstrap: str, overrides: Mapping[str, Any], timeout: float) -> dict[str, Any]:
    config = {
        k: v
        for k, v in overrides.items()
        if k not in CONSUMER_ONLY and not k.startswith(CONSUMER_ONLY_PREFIXES)
    }
    config.update(
        {
            "bootstrap.servers": bootstrap,
            "socket.timeout.ms": max(1000, int(timeout * 1000)),
            "log_level": "2",  # a broker that does not answer is the page's to say
        }
    )
    return config


def _wait(future: Future[Any], deadline: float) -> Any:
    return future.result(timeout=max(0.05, deadline - time.monotonic()))


def read_group_lags(
    bootstrap: str, overrides: Mapping[str, Any], timeout: float = 3.0
) -> GroupLags:
    """Every consumer group's lag per topic: the first :data:`MAX_GROUPS` groups by name."""
    deadline = time.monotonic() + timeout
    step = f"connecting to {bootstrap}"
    try:
        admin = AdminClient(_admin_config(bootstrap, overrides, timeout))
        step = "listing the consumer groups"
        listed = _wait(admin.list_consumer_groups(request_timeout=timeout), deadline)
        every = sorted(g.group_id for g in listed.valid)
        groups = every[:MAX_GROUPS]
        step = "reading the groups' committed offsets"
        asked = {
            group: next(
                iter(
                    admin.list_consumer_group_offsets(
                        [ConsumerGroupTopicPartitions(group)], request_timeout=timeout
                    ).values()
                )
            )
            for group in groups
        }
        committed: dict[str, dict[PartitionId, int | None]] = {}
        for group, future in asked.items():
            answer = _wait(future, deadline)
            committed[group] = {
                (tp.topic, tp.partition): tp.offset if tp.error is None else None
                for tp in answer.topic_partitions or ()
            }
        wanted = {tp for offsets in committed.values() for tp in offsets}
        ends: dict[PartitionId, int | None] = {}
        if wanted:
            step = "reading the topics' end offsets"
            latest = OffsetSpec.latest()  # type: ignore[no-untyped-call]
            futures = admin.list_offsets(
                {TopicPartition(t, p): latest for t, p in sorted(wanted)},
                request_timeout=timeout,
            )
            for tp, future in futures.items():
                try:
                    ends[(tp.topic, tp.partition)] = _wait(future, deadline).offset
                except KafkaException:  # this partition's end stays unknown
                    ends[(tp.topic, tp.partition)] = None
    except (KafkaException, TimeoutError, ValueError, TypeError) as exc:
        return GroupLags(error=f"{step}: {redact_text(_describe(exc))}")
    lags: list[TopicLag] = []
    for group in groups:
        lags.extend(topic_lags(group, committed[group], ends))
    return GroupLags(tuple(lags), tuple(groups), omitted=len(every) - len(groups))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "the broker did not answer in time"
    if isinstance(exc, KafkaException) and exc.args:
        error = exc.args[0]
        text = error.str() if hasattr(error, "str") else str(error)
        return f"{text} (the broker may not support this request)"
    return str(exc) or type(exc).__name__
