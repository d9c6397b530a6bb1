"""The relay's metrics and the metrics server under their earlier import path (a re-export)."""

from __future__ import annotations

from outbox._metrics_server import (
    DEFAULT_HOST,
    MAX_CONNECTIONS,
    MAX_REQUEST_BYTES,
    REQUEST_TIMEOUT,
    HealthSource,
    MetricsServer,
)
from outbox.relay._metrics import RelayMetrics

__all__ = [
    "DEFAULT_HOST",
    "MAX_CONNECTIONS",
    "MAX_REQUEST_BYTES",
    "REQUEST_TIMEOUT",
    "HealthSource",
    "MetricsServer",
    "RelayMetrics",
]
