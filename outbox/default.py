"""The default outbox's functions under the import path of earlier releases; ``outbox`` has them
too."""

from __future__ import annotations

from outbox.uow._default import configure, default_outbox, idempotent, unit_of_work

__all__ = ["configure", "default_outbox", "idempotent", "unit_of_work"]
