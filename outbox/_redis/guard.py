"""Redis side of the guard: the Lua scripts and the clients they run on.

State of one ``(scope, key)`` -- one hash, one Redis key (see
:func:`outbox._core.guard.record_key`)::

    s  status: P (processing), C (completed), F (failed), R (released)
    t  token of the current (or last) owner
    n  fence: +1 on every claim, kept across releases and takeovers
    d  lease deadline, in ms of the Redis server's clock (read for P only)
    f  fingerprint ('' for none)
    r  result JSON (C only)     e  error text (F only)

Each script reads and writes that one key and nothing else, so it is atomic and runs on any
Cluster node owning the key's slot. Every transition checks the owner's token; a record of
any other shape is reported as ``corrupt``, never guessed at. Scripts are safe to send twice:
a retried claim, finish or renewal by the same token answers as the first one did.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias, cast

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ConstantBackoff
from redis.connection import parse_url
from redis.exceptions import NoScriptError
from redis.retry import Retry

from outbox._core.guard import MAX_FENCE, MAX_LEASE
from outbox.config import redact_url
from outbox.errors import ConfigurationError

__all__ = [
    "CLAIM",
    "CLIENT_ERRORS",
    "FINISH",
    "RENEW",
    "AsyncClient",
    "AsyncRedisClient",
    "Client",
    "NoScriptError",
    "RedisClient",
    "Script",
    "as_async_client",
    "as_client",
    "check_url",
    "make_async_guard_client",
    "make_guard_client",
]

# A "Redis is down" answer within a second: a refused connection fails at once; a host that
# does not answer costs at most two attempts of connect (0.2 s) + read (0.3 s).
CONNECT_TIMEOUT = 0.2
SOCKET_TIMEOUT = 0.3
RETRIES = 1
RETRY_BACKOFF = 0.02

# What a failed client call raises: RedisError for a server that is down, slow or refusing,
# RedisClusterException (not a RedisError) for a cluster it cannot map, OSError -- and, from
# client bugs under concurrency, AttributeError and the like. The guard's policy (closed or
# open) must hold whatever the client raises, so every Exception counts as a Redis failure;
# the original stays chained to the GuardUnavailable.
CLIENT_ERRORS: tuple[type[Exception], ...] = (Exception,)

RedisClient: TypeAlias = redis.Redis | redis.cluster.RedisCluster
AsyncRedisClient: TypeAlias = redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster


@dataclass(frozen=True)
class Script:
    """A Lua script and its SHA1 (sent with EVALSHA; EVAL when the server lacks it)."""

    name: str
    text: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.text.encode("utf-8")).hexdigest())


_PRELUDE = f"""
local K = KEYS[1]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function int(x)
  return x and x == math.floor(x) and x >= 0 and x <= {MAX_FENCE}
end
-- The record: nil when there is none; false and a reason for any shape this guard never writes.
-- One HMGET reads all of it (a wrong type answers an error, which is caught).
local function load()
  local v = redis.pcall('HMGET', K, 's', 't', 'n', 'd', 'f', 'r', 'e')
  if v['err'] then return false, 'holds a ' .. redis.call('TYPE', K)['ok'] .. ', not a hash' end
  local rec = {{s = v[1], t = v[2], n = tonumber(v[3]), d = tonumber(v[4]), f = v[5] or '',
               r = v[6], e = v[7]}}
  if not rec.s then
    if redis.call('EXISTS', K) == 0 then return nil end
    return false, 'has no status'
  end
  if rec.s ~= 'P' and rec.s ~= 'C' and rec.s ~= 'F' and rec.s ~= 'R' then
    return false, 'has no valid status'
  end
  if not rec.t or rec.t == '' then return false, 'has no owner token' end
  if not int(rec.n) or rec.n < 1 then return false, 'has no valid fence' end
  if rec.s == 'C' and not rec.r then return false, 'is completed but holds no result' end
  if rec.s == 'F' and not rec.e then return false, 'is failed but holds no error' end
  return rec
end
-- A processing record's deadline, checked where it is used (claim, renew): a finish needs only
-- the owner's token.
local function deadline_ok(rec, now)
  return int(rec.d) and rec.d <= now + {round(MAX_LEASE * 1000)}
end
"""

# ARGV: token, lease_ms, fingerprint ('' for none), keep_ms.
# -> {'new', fence, takeover 0|1} | {'busy', ms left} | {'done', result, fingerprint}
#    | {'failed', error, fingerprint} | {'corrupt', reason}
# A duplicate of a completed key costs one HMGET; a new key HMGET, EXISTS, TIME, HSET, PEXPIRE.
CLAIM = Script(
    "claim",
    _PRELUDE
    + """
local token, lease, keep = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[4])
local rec, why = load()
if rec == false then return {'corrupt', why} end
local now
local fence, takeover = 1, 0
if rec then
  if rec.s == 'C' then return {'done', rec.r, rec.f} end
  if rec.s == 'F' then return {'failed', rec.e, rec.f} end
  if rec.s == 'P' then
    if rec.t == token then return {'new', rec.n, 0} end
    now = now_ms()
    if not deadline_ok(rec, now) then return {'corrupt', 'has no valid lease deadline'} end
    if now < rec.d then return {'busy', rec.d - now} end
    takeover = 1
  end
  fence = rec.n + 1
end
now = now or now_ms()
redis.call('HSET', K, 's', 'P', 't', token, 'n', string.format('%d', fence),
           'd', string.format('%d', now + lease), 'f', ARGV[3])
redis.call('PEXPIRE', K, lease + keep)
return {'new', fence, takeover}
""",
)

# ARGV: token, status C|F|R, value (result JSON, error text; ignored for R), ttl_ms.
# -> {'ok', fence} | {'lost', fence of the key now, 0 when it has no record} | {'corrupt', why}
FINISH = Script(
    "finish",
    _PRELUDE
    + """
local token, status = ARGV[1], ARGV[2]
local rec, why = load()
if rec == false then return {'corrupt', why} end
if not rec then return {'lost', 0} end
if rec.t ~= token then return {'lost', rec.n} end
if rec.s == status then return {'ok', rec.n} end
if rec.s ~= 'P' then return {'lost', rec.n} end
if status == 'C' then
  redis.call('HSET', K, 's', 'C', 'r', ARGV[3])
elseif status == 'F' then
  redis.call('HSET', K, 's', 'F', 'e', ARGV[3])
else
  redis.call('HSET', K, 's', 'R')
end
redis.call('PEXPIRE', K, tonumber(ARGV[4]))
return {'ok', rec.n}
""",
)

# ARGV: token, lease_ms, keep_ms.  -> {'ok', fence} | {'lost', fence} | {'corrupt', why}
RENEW = Script(
    "renew",
    _PRELUDE
    + """
local token, lease = ARGV[1], tonumber(ARGV[2])
local rec, why = load()
if rec == false then return {'corrupt', why} end
if not rec then return {'lost', 0} end
if rec.t ~= token or rec.s ~= 'P' then return {'lost', rec.n} end
local now = now_ms()
if not deadline_ok(rec, now) then return {'corrupt', 'has no valid lease deadline'} end
redis.call('HSET', K, 'd', string.format('%d', now + lease))
redis.call('PEXPIRE', K, lease + tonumber(ARGV[3]))
return {'ok', rec.n}
""",
)


class Client(Protocol):
    """What the guard needs of a redis-py client (``redis.Redis``, ``RedisCluster``)."""

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: str) -> Any: ...

    def eval(self, script: str, numkeys: int, *keys_and_args: str) -> Any: ...

    def close(self) -> None: ...


class AsyncClient(Protocol):
    """What the guard needs of a ``redis.asyncio`` client."""

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: str) -> Awaitable[Any]: ...

    def eval(self, script: str, numkeys: int, *keys_and_args: str) -> Awaitable[Any]: ...

    async def aclose(self) -> None: ...


def check_url(url: str, cluster: bool) -> None:
    """Refuse a URL redis-py cannot use, before any connection (passwords are redacted)."""
    try:
        options: dict[str, Any] = parse_url(url)  # type: ignore[no-untyped-call]
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(
            f"invalid Redis URL {redact_url(url)!r}: {exc} (expected redis://HOST:PORT/DB, "
            "rediss://... or unix://PATH)"
        ) from None
    if cluster and ("path" in options or options.get("db", 0) != 0):
        raise ConfigurationError(
            f"invalid Redis Cluster URL {redact_url(url)!r}: a cluster is reached over TCP and "
            "has only database 0 (redis://HOST:PORT of any master)"
        )


def _options() -> dict[str, Any]:
    return {
        "socket_timeout": SOCKET_TIMEOUT,
        "socket_connect_timeout": CONNECT_TIMEOUT,
        "health_check_interval": 0,
    }


def make_guard_client(url: str, cluster: bool) -> Client:
    """A client with bounded timeouts and one retry (the scripts are safe to send twice).

    A Cluster client is built at its first use: redis-py's sync ``RedisCluster`` asks the
    cluster for its slots when constructed, and that is I/O.
    """
    check_url(url, cluster)
    if cluster:
        return _LazyCluster(url)
    retry = Retry(ConstantBackoff(RETRY_BACKOFF), RETRIES)
    return cast(Client, redis.Redis.from_url(url, retry=retry, **_options()))


def make_async_guard_client(url: str, cluster: bool) -> AsyncClient:
    """The asyncio twin of :func:`make_guard_client` (a Cluster client connects when first used)."""
    check_url(url, cluster)
    retry = AsyncRetry(ConstantBackoff(RETRY_BACKOFF), RETRIES)
    if cluster:
        return _AsyncCluster(
            redis.asyncio.cluster.RedisCluster.from_url(url, retry=retry, **_options())
        )
    return cast(AsyncClient, redis.asyncio.Redis.from_url(url, retry=retry, **_options()))


class _LazyCluster:
    """A sync ``RedisCluster`` built at the first command (building it is I/O)."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._client: redis.cluster.RedisCluster | None = None

    def _get(self) -> redis.cluster.RedisCluster:
        # Two threads may build one each at the very first call; one is kept, both work.
        if self._client is None:
            client = redis.cluster.RedisCluster.from_url(
                self._url, retry=Retry(ConstantBackoff(RETRY_BACKOFF), RETRIES), **_options()
            )
            if self._client is None:
                self._client = client
            else:
                client.close()
        return self._client

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: str) -> Any:
        return self._get().evalsha(sha, numkeys, *keys_and_args)

    def eval(self, script: str, numkeys: int, *keys_and_args: str) -> Any:
        return self._get().eval(script, numkeys, *keys_and_args)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


class _AsyncCluster:
    """An asyncio ``RedisCluster`` that maps the cluster once, alone, before its first command.

    redis-py's asyncio cluster client (seen with redis-py 8.1) breaks connections when many
    coroutines send their first commands at once (``AttributeError: 'NoneType' object has no
    attribute 'writelines'``). ``initialize()`` serializes its callers on the client's own lock,
    so every first caller waits here until the map is complete.
    """

    def __init__(self, client: redis.asyncio.cluster.RedisCluster) -> None:
        self._client = client
        self._ready = False

    async def _get(self) -> redis.asyncio.cluster.RedisCluster:
        if not self._ready:
            await self._client.initialize()
            self._ready = True
        return self._client

    async def evalsha(self, sha: str, numkeys: int, *keys_and_args: str) -> Any:
        return await (await self._get()).evalsha(sha, numkeys, *keys_and_args)

    async def eval(self, script: str, numkeys: int, *keys_and_args: str) -> Any:
        return await (await self._get()).eval(script, numkeys, *keys_and_args)

    async def aclose(self) -> None:
        await self._client.aclose()


def as_client(value: object) -> Client:
    """A caller's sync client, or a clear error for anything else."""
    if isinstance(value, redis.Redis | redis.cluster.RedisCluster):
        return cast(Client, value)
    raise ConfigurationError(
        f"RedisGuard needs a Redis URL, a redis.Redis or a redis.cluster.RedisCluster, got "
        f"{type(value).__name__} (redis.asyncio clients go to AsyncRedisGuard)"
    )


def as_async_client(value: object) -> AsyncClient:
    """A caller's asyncio client, or a clear error for anything else."""
    if isinstance(value, redis.asyncio.cluster.RedisCluster):
        return _AsyncCluster(value)
    if isinstance(value, redis.asyncio.Redis):
        return cast(AsyncClient, value)
    raise ConfigurationError(
        f"AsyncRedisGuard needs a Redis URL, a redis.asyncio.Redis or a "
        f"redis.asyncio.cluster.RedisCluster, got {type(value).__name__} (sync clients go to "
        "RedisGuard)"
    )
