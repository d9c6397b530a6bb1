"""The relay: moves committed outbox rows to Kafka, in order per key, and deletes them once sent.

Invariant: a row is sent only when no earlier row of its key is left in the table outside the
relay's own claim, and deleted only after the brokers acknowledged it.
"""

from __future__ import annotations

from outbox.relay._fleet import Fleet, FleetConfig
from outbox.relay._relay import BatchResult, Relay, RelayConfig, RunResult, relay_max_silence

__all__ = [
    "BatchResult",
    "Fleet",
    "FleetConfig",
    "Relay",
    "RelayConfig",
    "RunResult",
    "relay_max_silence",
]
