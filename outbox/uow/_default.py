"""The default :class:`~outbox.Outbox` behind ``outbox.unit_of_work`` and ``@outbox.idempotent``.

Invariant: one default outbox per process, built once (under a lock) on first use from
``OUTBOX_DATABASE_URL`` / ``OUTBOX_REDIS_URL``, or the one set with :func:`configure`.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any, Literal

import sqlalchemy as sa

from outbox._core.typed_results import ResultCodec
from outbox.config import (
    DEFAULT_SCOPE,
    ENV_DATABASE_URL,
    ENV_POOLER,
    ENV_REDIS_URL,
    OutboxConfig,
    check_pooler,
    env,
)
from outbox.errors import ConfigurationError
from outbox.uow._decorators import make_idempotent
from outbox.uow._outbox import Outbox, _Attempt
from outbox.uow._outbox_async import AsyncOutbox

_default: Outbox | None = None
_default_lock = threading.Lock()


def configure(database: str | sa.Engine | None = None, **options: Any) -> Outbox:
    """Set the default :class:`Outbox` used by :func:`unit_of_work` and :func:`idempotent`.

    Without ``database`` it reads ``OUTBOX_DATABASE_URL`` (and ``OUTBOX_REDIS_URL`` unless
    ``redis_url``/``redis`` is passed, ``OUTBOX_POOLER`` unless ``config`` is). Replaces and
    closes a previous default.
    """
    global _default
    if database is None:
        database = env(ENV_DATABASE_URL)
        if database is None:
            raise ConfigurationError(
                f"no database configured: call outbox.configure(url) or set {ENV_DATABASE_URL}"
            )
        if "redis_url" not in options and "redis" not in options:
            options["redis_url"] = env(ENV_REDIS_URL)
        if "config" not in options:
            options["config"] = _config_from_env(options.pop("schema", None))
    new = Outbox(database, **options)
    with _default_lock:
        old, _default = _default, new
    if old is not None:
        old.close()
    return new


def default_outbox() -> Outbox:
    """The default :class:`Outbox`, built from the environment on first use."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                url = env(ENV_DATABASE_URL)
                if url is None:
                    raise ConfigurationError(
                        "no default Outbox: call outbox.configure(url) or set "
                        f"{ENV_DATABASE_URL} (and optionally {ENV_REDIS_URL})"
                    )
                _default = Outbox(url, redis_url=env(ENV_REDIS_URL), config=_config_from_env())
    return _default


def _config_from_env(schema: str | None = None) -> OutboxConfig:
    """``OUTBOX_POOLER`` (a connection pooler in transaction mode in between, or not)."""
    pooler = env(ENV_POOLER)
    check_pooler(ENV_POOLER, pooler)
    return OutboxConfig(schema=schema, pooler=pooler)


def unit_of_work(
    key: str,
    scope: str = DEFAULT_SCOPE,
    fingerprint: str | None = None,
    *,
    result_type: Any = None,
    result_codec: ResultCodec | None = None,
) -> _Attempt:
    """:meth:`Outbox.unit_of_work` on the default :class:`Outbox`."""
    return default_outbox().unit_of_work(
        key, scope=scope, fingerprint=fingerprint, result_type=result_type,
        result_codec=result_codec,
    )  # fmt: skip


def idempotent(
    key: str | Callable[..., str],
    *,
    scope: str = DEFAULT_SCOPE,
    fingerprint: Callable[..., str | None] | Literal[False] | None = None,
    outbox: Outbox | AsyncOutbox | None = None,
    result_type: Any = None,
    result_codec: ResultCodec | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run the decorated function at most once per idempotency key.

    The function takes the :class:`~outbox.uow.UnitOfWork` as its first parameter, followed by
    its own arguments; callers pass only their own arguments::

        @outbox.idempotent(key="request_id", scope="payments")
        def charge(uow, request_id: str, amount: int) -> dict:
            uow.connection.execute(...)
            uow.publish("payments.charged", {"amount": amount}, key=request_id)
            return {"charged": amount}

        charge("req-1", 500)   # runs, stores {"charged": 500}
        charge("req-1", 500)   # returns {"charged": 500} without calling the function

    ``key`` names the parameter that holds the idempotency key, or is a callable that receives
    the caller's arguments and returns the key. The call's arguments are the request's
    fingerprint: the same key with other arguments raises :class:`~outbox.errors.KeyReuseError`
    rather than replaying another call's result. ``fingerprint`` replaces that with a callable
    of the same arguments returning a fingerprint of your own, or ``False`` compares keys only.
    The return value must be JSON-serializable: it is stored and a duplicate gets its JSON form
    back (tuples come back as lists) -- unless ``result_type`` declares its type (a pydantic
    model, a dataclass, ``Decimal``, ``UUID``, ``datetime``...; or ``result_codec`` encodes it):
    a duplicate then gets an equal value of that type. ``outbox`` defaults to the module-level
    default (:func:`outbox.configure`), looked up at call time. With ``outbox=`` an
    :class:`~outbox.AsyncOutbox`, decorate an ``async def``: the decorator takes the flavour of
    the outbox it is given (``AsyncOutbox.idempotent`` does the same).
    """
    if outbox is not None:
        if not isinstance(outbox, Outbox | AsyncOutbox):
            raise ConfigurationError(
                f"@idempotent(outbox=...) takes an Outbox or an AsyncOutbox, got "
                f"{type(outbox).__name__}"
            )
        return outbox.idempotent(
            key,
            scope=scope,
            fingerprint=fingerprint,
            result_type=result_type,
            result_codec=result_codec,
        )
    decorate = make_idempotent(
        default_outbox, key, scope, fingerprint, is_async=False,
        result_type=result_type, result_codec=result_codec,
    )  # fmt: skip

    def on_the_default(func: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(func):
            raise ConfigurationError(
                f"@outbox.idempotent on {getattr(func, '__qualname__', func)!r}: the default "
                "outbox is a (sync) Outbox; for an async def pass outbox=an AsyncOutbox"
            )
        return decorate(func)

    return on_the_default
