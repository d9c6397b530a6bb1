"""The metrics page of a relay fleet: every served database's relay metrics with a
``database`` label, and the fleet's own series (which databases this member serves, the
members it sees).

Each database's relay keeps its own registry (:mod:`outbox.relay._metrics`); the page merges
them at each scrape, so one scrape of a member covers every database it serves, and
``sum by (database)`` over the members covers the fleet. The alert rules
(``deploy/prometheus/outbox-fleet-alerts.yml``) and the dashboard work per database on these
labels.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from outbox.config import FleetConfig
    from outbox.relay._relay import Relay

# The label the fleet adds to each database's series (``host:port/name``).
DATABASE_LABEL = "database"


class FleetView(Protocol):
    """What the page reads of a fleet (:class:`outbox.relay.Fleet`)."""

    @property
    def config(self) -> FleetConfig: ...
    @property
    def databases(self) -> Mapping[str, object]: ...
    @property
    def members(self) -> set[int]: ...
    @property
    def served(self) -> dict[str, Relay]: ...
    @property
    def stop_event(self) -> threading.Event: ...


class FleetMetrics(Collector):
    """``/metrics``, ``/healthz`` and ``/readyz`` of a fleet member (a
    :class:`outbox._metrics_server.HealthSource`)."""

    def __init__(self, fleet: FleetView) -> None:
        self.fleet = fleet
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.heartbeat = time.monotonic()

    def beat(self) -> None:
        """The fleet's loop turned."""
        self.heartbeat = time.monotonic()

    def collect(self) -> Iterator[Metric]:
        fleet = self.fleet
        member = fleet.config.member_id
        families: dict[str, Metric] = {}
        for identity, relay in sorted(fleet.served.items()):
            for family in relay.metrics.registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = Metric(family.name, family.documentation, family.type, family.unit)
                    families[family.name] = merged
                for sample in family.samples:
                    merged.add_sample(
                        sample.name,
                        {DATABASE_LABEL: identity, **sample.labels},
                        sample.value,
                        sample.timestamp,
                        sample.exemplar,
                    )
        yield from families.values()
        served = GaugeMetricFamily(
            "outbox_fleet_database_served",
            "1 for each database this member serves now, 0 for the databases it knows and "
            "another member (or nobody) serves: max by (database) is 0 for a database nobody "
            "serves",
            labels=[DATABASE_LABEL, "member"],
        )
        serving = fleet.served
        for identity in sorted(fleet.databases):
            served.add_metric([identity, member], 1.0 if identity in serving else 0.0)
        yield served
        yield GaugeMetricFamily(
            "outbox_fleet_databases",
            "Databases this member knows (listed, in the file, discovered)",
            value=len(fleet.databases),
        )
        yield GaugeMetricFamily(
            "outbox_fleet_members",
            "Live members of the fleet this member sees (itself included)",
            value=len(fleet.members),
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def healthy(self, max_silence: float) -> bool:
        """The fleet's loop turns (each database's own trouble is in its series)."""
        return time.monotonic() - self.heartbeat <= max_silence

    def ready(self, max_silence: float) -> bool:
        return not self.fleet.stop_event.is_set() and self.healthy(max_silence)
