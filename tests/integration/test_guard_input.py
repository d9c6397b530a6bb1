"""Bad input to the guard is refused before any Redis command: counted on a private server."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings, strategies as st

from outbox.errors import ConfigurationError, ValidationError
from outbox.guard import AsyncRedisGuard, RedisGuard
from tests.fixtures.guard import bad_fingerprints, bad_keys, bad_scopes, bad_seconds
from tests.fixtures.redis import PrivateRedis

bad_settings = st.one_of(
    st.builds(lambda v: {"lease": v}, bad_seconds),
    st.builds(lambda v: {"completed_ttl": v}, bad_seconds),
    st.builds(lambda v: {"failed_ttl": v}, bad_seconds),
    st.builds(
        lambda v: {"on_redis_error": v},
        st.one_of(st.none(), st.integers(), st.text(max_size=8)).filter(
            lambda v: v not in ("open", "closed")
        ),
    ),
    st.builds(lambda v: {"prefix": v}, st.sampled_from(["", "a{b", "}", "x" * 65, 7, None])),
    st.builds(lambda v: {"renew": v}, st.sampled_from([1, "yes", None])),
    st.builds(lambda v: {"cluster": v}, st.sampled_from([1, "no"])),
)
unserializable = st.one_of(
    st.just(object()),
    st.just({1j}),
    st.just(math.nan),
    st.just({"k": [math.inf]}),
    st.just(b"bytes"),
    st.just("nul \x00"),
)


def commands(admin: redis.Redis) -> dict[str, Any]:
    return {name: v for name, v in admin.info("commandstats").items()}


def test_bad_input_sends_no_redis_command(private_redis: Callable[..., PrivateRedis]) -> None:
    server = private_redis()
    admin = redis.Redis.from_url(server.url, socket_timeout=5)
    sync_guard = RedisGuard(server.url)
    async_guard = AsyncRedisGuard(server.url)
    own_client = redis.Redis.from_url(server.url)
    admin.config_resetstat()
    connections = admin.info("stats")["total_connections_received"]

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        which=st.sampled_from(["key", "scope", "fingerprint", "settings", "result", "decorator"]),
        key=bad_keys,
        scope=bad_scopes,
        fingerprint=bad_fingerprints,
        config=bad_settings,
        result=unserializable,
    )
    def attempt(
        which: str,
        key: object,
        scope: object,
        fingerprint: object,
        config: dict[str, Any],
        result: object,
    ) -> None:
        with pytest.raises((ValidationError, ConfigurationError)):
            if which == "settings":
                for target in (server.url, own_client):
                    with pytest.raises(ConfigurationError):
                        RedisGuard(target, **config)
                AsyncRedisGuard(server.url, **config)
            elif which == "result":
                sync_guard.claim("fine").result = result
            elif which == "decorator":
                sync_guard.idempotent(key="k", scope=scope)  # type: ignore[arg-type]
            else:
                args: dict[str, Any] = {"key": "fine", "scope": "default", "fingerprint": None}
                args[which] = {"key": key, "scope": scope, "fingerprint": fingerprint}[which]
                for guard in (sync_guard, async_guard):
                    with pytest.raises(ValidationError):
                        guard.claim(**args)
                raise ValidationError("all refused")

    attempt()
    assert set(commands(admin)) <= {"cmdstat_config|resetstat", "cmdstat_info"}, commands(admin)
    assert admin.info("stats")["total_connections_received"] == connections
    # The counters do see the guard when it has something to do.
    with sync_guard.claim("fine") as claim:
        claim.result = 1
    assert commands(admin)["cmdstat_evalsha"]["calls"] >= 2
    sync_guard.close()
    own_client.close()
    admin.close()
