"""The Redis idempotency guard on redis.asyncio clients (the source of the sync guard).

Invariant: a claim holds its key for a *lease*, and an outcome is stored only by the key's
current owner: a late outcome after a takeover raises :class:`~outbox.errors.LeaseLost`.
``claim.fence`` grows with every owner of a key, so downstream systems can refuse a stale one;
a lease is a clock, weaker than the unit of work (``docs/guard.md``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar

from outbox._core import guard as core, validate as _validate
from outbox._core.failures import is_permanent
from outbox._redis import guard as rg
from outbox.config import DEFAULT_SCOPE
from outbox.errors import (
    ConfigurationError,
    GuardUnavailable,
    LeaseLost,
    ReplayedWriteError,
)
from outbox.guard._heartbeat import AsyncHeartbeat

__all__ = ["AsyncClaim", "AsyncRedisGuard"]

log = logging.getLogger("outbox.guard")

R = TypeVar("R")

_ASYNC = True


class AsyncRedisGuard:
    """At most one run per ``(scope, key)`` for bodies whose effects live outside PostgreSQL.

    ``redis`` is a URL (``redis://HOST:PORT/DB``; with ``cluster=True`` any master of a Redis
    Cluster) or a client of your own (redis.asyncio.Redis, redis.asyncio.cluster.RedisCluster),
    which the guard then never closes. A client built from a URL has bounded timeouts and one
    retry, so an unreachable Redis is known within a second.

    * ``lease`` (seconds): how long a claim holds its key. An owner that died or stalled is
      taken over after it; its late outcome then raises :class:`~outbox.errors.LeaseLost`.
    * ``on_redis_error``: ``"closed"`` raises :class:`~outbox.errors.GuardUnavailable` without
      running the body when the guard cannot decide; ``"open"`` runs the body unguarded and
      logs a warning -- it may then run twice.
    * ``completed_ttl`` / ``failed_ttl`` (seconds): how long results and permanent failures are
      replayed.
    * ``renew``: renew the lease every third of it while a body runs (off by default: a renewed
      lease also keeps a key held by an owner that is alive but stuck).
    * ``prefix``: the start of every Redis key the guard writes.
    * ``permanent_errors``: exception classes that, like
      :class:`~outbox.errors.PermanentError`, record the key as failed.
    * ``secret``: signs COMPLETED and FAILED records (at least 16 bytes, the same in every
      process sharing the guard's Redis). A record that is not signed with it -- forged by a
      Redis writer, moved from another key, kept past its expiry -- is never replayed: it is
      ``GuardUnavailable``. Without a secret, whoever can write to the guard's Redis decides
      its outcomes.

    Settings are checked at once, before any Redis command: a bad one raises
    :class:`~outbox.errors.ConfigurationError`.
    """

    def __init__(
        self,
        redis: str | rg.AsyncRedisClient,
        *,
        lease: float = core.DEFAULT_LEASE,
        on_redis_error: str = "closed",
        completed_ttl: float = core.DEFAULT_COMPLETED_TTL,
        failed_ttl: float = core.DEFAULT_FAILED_TTL,
        renew: bool = False,
        prefix: str = core.DEFAULT_PREFIX,
        cluster: bool = False,
        permanent_errors: tuple[type[BaseException], ...] = (),
        secret: bytes | str | None = None,
    ) -> None:
        self.settings = core.GuardConfig(
            lease=lease,
            on_redis_error=on_redis_error,
            completed_ttl=completed_ttl,
            failed_ttl=failed_ttl,
            prefix=prefix,
            renew=renew,
            permanent_errors=permanent_errors,
            secret=secret,
        ).validate()
        self._signing_key = self.settings.signing_key
        if not isinstance(cluster, bool):
            raise ConfigurationError(f"cluster must be True or False, got {cluster!r}")
        self._owns_client = isinstance(redis, str)
        self._client: rg.AsyncClient
        if isinstance(redis, str):
            self._client = rg.make_async_guard_client(redis, cluster)
        else:
            self._client = rg.as_async_client(redis)

    def claim(
        self, key: str, scope: str = DEFAULT_SCOPE, fingerprint: str | None = None
    ) -> AsyncClaim:
        """Claim ``(scope, key)`` for the ``async with`` block that follows.

        Entering the block gives one of: the key is this owner's (``replayed`` false: run the
        body; a clean exit stores ``claim.result``, :class:`~outbox.errors.PermanentError`
        (or one of ``permanent_errors``) stores the failure, any other exception frees the key
        at once); a stored result (``replayed`` true: return ``claim.result``); or an
        exception --
        :class:`~outbox.errors.KeyInProgress` (another owner holds the key; never waits),
        :class:`~outbox.errors.PreviouslyFailed`, :class:`~outbox.errors.KeyReuseError`
        (another ``fingerprint``), :class:`~outbox.errors.GuardUnavailable` (policy
        ``"closed"``). Invalid arguments raise a ``ValidationError`` here, before any I/O.
        """
        _validate.check_key(key)
        _validate.check_scope(scope)
        _validate.check_fingerprint(fingerprint)
        return AsyncClaim(self, key, scope, fingerprint)

    async def run(
        self,
        key: str,
        fn: Callable[[AsyncClaim], Awaitable[R]],
        *,
        scope: str = DEFAULT_SCOPE,
        fingerprint: str | None = None,
    ) -> R:
        """Run ``fn(claim)`` under a claim of ``(scope, key)`` and store what it returns.

        A duplicate returns the stored result (its JSON form: tuples come back as lists)
        without calling ``fn``. Raises what :meth:`claim` raises, and what ``fn`` raises.
        """
        async with self.claim(key, scope, fingerprint) as claim:
            if claim.replayed:
                replayed: R = claim.result
                return replayed
            value = await fn(claim)
            claim.result = value
            return value

    def idempotent(
        self,
        key: str | Callable[..., str],
        *,
        scope: str = DEFAULT_SCOPE,
        fingerprint: Callable[..., str | None] | None = None,
    ) -> Callable[[Callable[..., Awaitable[Any]]], Callable[..., Awaitable[Any]]]:
        """Decorate a function to run at most once per key; duplicates get its stored result.

        The function takes the claim as its first parameter and its own arguments after it;
        callers pass only their own arguments::

            @guard.idempotent(key="request_id", scope="mail")
            async def send_receipt(claim, request_id: str, to: str) -> dict:
                return {"message_id": await mailer.send(to, ...)}

        ``key`` names the parameter holding the key, or is a callable of the caller's
        arguments returning it; ``fingerprint`` is an optional callable of the same arguments.
        The return value must be JSON-serializable.
        """
        _validate.check_scope(scope)
        if fingerprint is not None and not callable(fingerprint):
            raise ConfigurationError(
                f"@idempotent fingerprint must be a callable or None, got {fingerprint!r}"
            )

        def decorate(func: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
            key_of = core.guard_arguments_key(func, key, _ASYNC)

            @functools.wraps(func)
            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                fp = fingerprint(*args, **kwargs) if fingerprint is not None else None

                async def body(claim: AsyncClaim) -> Any:
                    return await func(claim, *args, **kwargs)

                return await self.run(key_of(*args, **kwargs), body, scope=scope, fingerprint=fp)

            return wrapper

        return decorate

    async def aclose(self) -> None:
        """Close the client the guard built from a URL (a caller's client stays open)."""
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> AsyncRedisGuard:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _call(self, script: rg.Script, claim: AsyncClaim, *args: str) -> Any:
        """One script call on the claim's key: one round trip (two if Redis lacks the script)."""
        try:
            try:
                return await self._client.evalsha(script.sha, 1, claim.redis_key, *args)
            except rg.NoScriptError:
                return await self._client.eval(script.text, 1, claim.redis_key, *args)
        except rg.CLIENT_ERRORS as exc:
            raise core.redis_failed(claim.scope, claim.key, exc) from exc


class AsyncClaim:
    """One attempt at a key, from :meth:`AsyncRedisGuard.claim`; use it in ``async with``.

    * ``replayed``: the key completed earlier; ``result`` is its stored result.
    * ``result``: set it in the body; it is stored when the block ends. A value that is not
      JSON-serializable raises ``SerializationError`` (a ``ValidationError``) at once.
    * ``token``: this owner's unique token; every transition of the key checks it.
    * ``fence``: a number that strictly increases for the key with every owner (across
      releases and takeovers). Pass it to downstream writes so they can refuse stale owners.
    * ``guarded``: false when Redis could not answer and ``on_redis_error="open"`` let the body
      run without the guard (``fence`` is then 0, lower than any fence the guard gives).
    """

    def __init__(
        self, guard: AsyncRedisGuard, key: str, scope: str, fingerprint: str | None
    ) -> None:
        self.key = key
        self.scope = scope
        self.fingerprint = fingerprint
        self.redis_key = core.record_key(guard.settings.prefix, scope, key)
        self.token = core.new_token()
        self.fence = 0
        self.replayed = False
        self.guarded = False
        self._guard = guard
        self._result: Any = None
        self._result_json = "null"
        self._state = "new"  # new -> owner | replayed | unguarded -> done
        self._heartbeat: AsyncHeartbeat | None = None

    @property
    def result(self) -> Any:
        """The result to store (owner) or the stored result (replayed)."""
        return self._result

    @result.setter
    def result(self, value: Any) -> None:
        if self.replayed:
            raise ReplayedWriteError(
                f"key {self.key!r} in scope {self.scope!r} replays a stored result: return "
                "claim.result instead of setting it"
            )
        self._result_json = _validate.dumps_json(value, "guard result")
        self._result = value

    async def __aenter__(self) -> AsyncClaim:
        if self._state != "new":
            raise RuntimeError("a claim can be entered only once; call guard.claim() again")
        self._state = "done"
        settings = self._guard.settings
        try:
            reply = await self._guard._call(
                rg.CLAIM,
                self,
                self.token,
                str(settings.lease_ms),
                self.fingerprint or "",
                str(settings.keep_ms),
            )
            verdict = core.decode_claim(
                reply,
                self.scope,
                self.key,
                self.fingerprint,
                self.redis_key,
                self._guard._signing_key,
                int(time.time() * 1000),
            )
        except GuardUnavailable as exc:
            if settings.on_redis_error == "closed":
                raise core.not_run(exc) from exc
            log.warning(
                "%s; on_redis_error='open': running the body without the guard, so it may run "
                "twice",
                exc,
            )
            self._state = "unguarded"
            return self
        if isinstance(verdict, core.Replay):
            self.replayed = True
            self._result = verdict.result
            self._state = "replayed"
            return self
        self.fence = verdict.fence
        self.guarded = True
        self._state = "owner"
        if verdict.takeover:
            log.warning(
                "key %r in scope %r: the previous owner's lease ran out; taken over with fence %d",
                self.key,
                self.scope,
                self.fence,
            )
        if settings.renew:
            self._heartbeat = AsyncHeartbeat(
                settings.renew_interval, self._renew, f"outbox-guard-renew-{self.fence}"
            )
            self._heartbeat.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._state != "owner":
            return
        self._state = "done"
        if self._heartbeat is not None:
            await self._heartbeat.stop()
        settings = self._guard.settings
        if exc is None:
            await self._finish("C", self._result_json, settings.completed_ttl_ms)
        elif is_permanent(exc, settings.permanent_errors):
            await self._finish("F", core.error_text(exc), settings.failed_ttl_ms)
        else:
            # Any other exception frees the key at once, so that a retry runs immediately.
            try:
                await self._finish("R", "", settings.keep_ms)
            except (GuardUnavailable, LeaseLost) as err:
                log.warning("key %r in scope %r was not released: %s", self.key, self.scope, err)

    async def _finish(self, status: str, value: str, ttl_ms: int) -> None:
        settings = self._guard.settings
        signing_key = self._guard._signing_key
        if signing_key is not None and status != "R":
            expires_ms = int(time.time() * 1000) + ttl_ms
            value = core.sign_outcome(
                signing_key, self.redis_key, status, self.fingerprint or "", value, expires_ms
            )
        try:
            reply = await self._guard._call(rg.FINISH, self, self.token, status, value, str(ttl_ms))
            done = core.decode_transition(reply, self.scope, self.key, self.redis_key)
        except GuardUnavailable as exc:
            if status == "R":
                raise
            if settings.on_redis_error == "closed":
                raise core.not_recorded(self.scope, self.key, settings.lease, exc) from exc
            log.warning("%s; on_redis_error='open': carrying on", exc)
            return
        if not done.ok:
            raise LeaseLost(self.scope, self.key, self.fence, done.fence)

    async def _renew(self) -> bool:
        """One heartbeat: False once the lease is lost (the beats stop)."""
        settings = self._guard.settings
        try:
            reply = await self._guard._call(
                rg.RENEW, self, self.token, str(settings.lease_ms), str(settings.keep_ms)
            )
            renewed = core.decode_transition(reply, self.scope, self.key, self.redis_key)
        except GuardUnavailable as exc:
            log.warning("lease renewal failed, trying again: %s", exc)
            return True
        if not renewed.ok:
            log.warning(
                "key %r in scope %r: lease lost to another owner (fence %d); renewal stops",
                self.key,
                self.scope,
                renewed.fence,
            )
        return renewed.ok
