"""Dead letters for operators (``outbox dlq``, the console): read, group by failure, redrive.

Invariant: a redriven message carries its original key, value and headers, without the
``outbox.dlq.*`` headers of its failure and with ``outbox.redrive-count`` raised by one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any

from outbox._core.dlq import REDRIVE_HEADER, Group, Letter, group_letters, redrive_headers
from outbox._core.validate import check_topic
from outbox.errors import ConfigurationError

__all__ = ["REDRIVE_HEADER", "Group", "Letter", "read_groups", "redrive"]


def _kafka() -> ModuleType:
    """The Kafka side of dead letters, loaded on first use."""
    from outbox._kafka import dlq  # why: `outbox status`, `gc` and `parked` never load Kafka

    return dlq


def read_groups(
    bootstrap_servers: str,
    topic: str,
    *,
    kafka_config: Mapping[str, Any] | None = None,
    limit: int = 100_000,
) -> list[Group]:
    """The dead letters of ``topic`` (at most ``limit``) grouped by failure, biggest first."""
    check_topic(topic)
    return group_letters(_kafka().read_letters(bootstrap_servers, kafka_config or {}, topic, limit))


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
        _kafka().produce_all(bootstrap_servers, kafka_config or {}, records)
    return len(records)
