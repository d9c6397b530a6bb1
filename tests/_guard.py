"""Helpers of the guard tests: where a guard runs (one Redis or a Cluster) and its key prefix."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import redis
import redis.cluster

from outbox.guard import RedisGuard
from outbox.guard_async import AsyncRedisGuard


@dataclass(frozen=True)
class Target:
    """A Redis the guard runs on: a single server or a cluster (``url`` names a startup node)."""

    name: str
    url: str
    cluster: bool

    def guard(self, **settings: Any) -> RedisGuard:
        """A guard built from the URL, with a key prefix of its own unless one is given."""
        settings.setdefault("prefix", new_prefix())
        return RedisGuard(self.url, cluster=self.cluster, **settings)

    def async_guard(self, **settings: Any) -> AsyncRedisGuard:
        settings.setdefault("prefix", new_prefix())
        return AsyncRedisGuard(self.url, cluster=self.cluster, **settings)

    def client(self) -> redis.Redis | redis.cluster.RedisCluster:
        """A plain client, to look at or tamper with what the guard stored."""
        if self.cluster:
            return redis.cluster.RedisCluster.from_url(self.url, socket_timeout=5)
        return redis.Redis.from_url(self.url, socket_timeout=5)


def new_prefix() -> str:
    return f"gt-{uuid.uuid4().hex[:12]}"
