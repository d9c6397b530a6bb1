"""Helpers of the guard tests: where a guard runs (one Redis or a Cluster) and its key prefix."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any

import redis
import redis.cluster
from hypothesis import strategies as st

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


# Input the guard must refuse before any I/O (hypothesis strategies).

not_a_number = st.one_of(
    st.none(), st.booleans(), st.text(max_size=5), st.lists(st.integers(), max_size=2)
)
bad_seconds = st.one_of(
    not_a_number,
    st.sampled_from([math.nan, math.inf, -math.inf, 0, 0.0, -1, 10.0**12]),
    st.floats(max_value=0, allow_nan=False),
)
bad_keys = st.one_of(
    st.none(),
    st.integers(),
    st.binary(max_size=5),
    st.just(""),
    st.text(min_size=256, max_size=300),
    st.text(max_size=10).map(lambda s: s + "\x00"),
    st.just("\ud800"),
)
bad_scopes = st.one_of(
    st.none(),
    st.integers(),
    st.just(""),
    st.text(min_size=101, max_size=120, alphabet="ab"),
    st.text(min_size=1, max_size=10).filter(lambda s: any(c in s for c in " {}\n\x00é#")),
)
bad_fingerprints = st.one_of(
    st.integers(), st.just(""), st.text(min_size=513, max_size=520), st.just("a\nb")
)
