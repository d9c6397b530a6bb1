"""``outbox parked``: list, retry or discard parked outbox rows."""

from outbox.parked import register_cli as register

__all__ = ["register"]
