"""``outbox status`` and ``outbox gc`` (transitional: both registered by outbox.admin)."""

from outbox.admin import register_cli as register

__all__ = ["register"]
