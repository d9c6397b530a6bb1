"""The Redis guard: at most one run per ``(scope, key)`` for effects outside PostgreSQL.

Invariant: a key has at most one owner whose lease has not run out; every transition checks the
owner's token, and the fence grows with every owner.
"""

from __future__ import annotations

from outbox.guard._guard import Claim, RedisGuard
from outbox.guard._guard_async import AsyncClaim, AsyncRedisGuard

__all__ = ["AsyncClaim", "AsyncRedisGuard", "Claim", "RedisGuard"]
