"""``outbox consume``: run a handler on Kafka messages through units of work."""

from outbox.consumer import register_cli as register

__all__ = ["register"]
