"""Dead letters for operators (``outbox dlq`` and the console's dead-letters page): read a
dead-letter topic, group its records by failure, send chosen ones back to their original topic.

A redriven message carries its original key, value and headers, without the ``outbox.dlq.*``
headers of its failure and with ``outbox.redrive-count`` raised by one, so a message that keeps
failing shows how often it came back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from outbox._core.dlq import REDRIVE_HEADER, Group, Letter, group_letters, redrive_headers
from outbox._core.validate import check_topic
from outbox._kafka.dlq import produce_all, read_letters
from outbox.errors import ConfigurationError

__all__ = ["REDRIVE_HEADER", "Group", "Letter", "read_groups", "redrive"]


def read_groups(
    bootstrap_servers: str,
    topic: str,
    *,
    kafka_config: Mapping[str, Any] | None = None,
    limit: int = 100_000,
) -> list[Group]:
    """The dead letters of ``topic`` (at most ``limit``) grouped by failure, biggest first."""
    check_topic(topic)
    return group_letters(read_letters(bootstrap_servers, kafka_config or {}, topic, limit))


def redrive(
    bootstrap_servers: str,
    letters: Iterable[Letter],
    *,
    kafka_config: Mapping[str, Any] | None = None,
    dry_run: bool = False,
) -> int:
    """Send ``letters`` back to their original topics and wait for the broker; returns how
    many. Refuses, before sending any, letters whose original topic is unknown."""
    chosen = list(letters)
    unknown = [x.ref for x in chosen if x.info is None]
    if unknown:
        raise ConfigurationError(
            f"{len(unknown)} chosen record(s) carry no outbox.dlq.* headers, so their original "
            f"topic is unknown (first: {unknown[0]})"
        )
    records = [
        (x.info.topic, x.key, x.value, redrive_headers(x.headers))
        for x in chosen
        if x.info is not None
    ]
    if records and not dry_run:
        produce_all(bootstrap_servers, kafka_config or {}, records)
    return len(records)
