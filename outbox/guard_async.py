"""The asyncio guard under the import path of earlier releases; :mod:`outbox.guard` has it too."""

from __future__ import annotations

from outbox.guard._guard_async import (
    AsyncClaim,
    AsyncRedisGuard,
)

__all__ = [
    "AsyncClaim",
    "AsyncRedisGuard",
]
