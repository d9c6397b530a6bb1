"""The relay: moves committed outbox rows to Kafka, in order per key, and deletes them once the
brokers acknowledged them.

The loop and its invariants are in the private ``_relay`` module, the lanes it owns in
``_lanes``; :class:`Relay` and :class:`RelayConfig` are the public face.
"""

from __future__ import annotations

from outbox.relay._relay import BatchResult, Relay, RelayConfig, RunResult, relay_max_silence

__all__ = ["BatchResult", "Relay", "RelayConfig", "RunResult", "relay_max_silence"]
