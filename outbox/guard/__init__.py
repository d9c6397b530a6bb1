"""The Redis guard: at most one run per ``(scope, key)`` for work whose effects live outside
PostgreSQL.

:class:`RedisGuard` (and :class:`AsyncRedisGuard`) hand out a :class:`Claim` (an
:class:`AsyncClaim`) per key. The modules in this folder are private; the sync guard is
generated from its ``_async`` source by ``tools/async_to_sync.py``.
"""

from __future__ import annotations

from outbox.guard._guard import Claim, RedisGuard
from outbox.guard._guard_async import AsyncClaim, AsyncRedisGuard

__all__ = ["AsyncClaim", "AsyncRedisGuard", "Claim", "RedisGuard"]
