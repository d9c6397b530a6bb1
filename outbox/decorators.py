"""``@idempotent``: run a function inside a unit of work, replay its result to duplicates.

The wrapping is written here once; :func:`outbox.idempotent` and :meth:`outbox.Outbox.idempotent`
(in :mod:`outbox.uow`) supply the outbox it runs on.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Protocol

from outbox._core.validate import check_scope
from outbox.errors import ConfigurationError


class _UnitOfWorkSource(Protocol):
    """What the decorator needs of an outbox: units of work (``Outbox`` is one)."""

    def unit_of_work(self, key: str, scope: str = ..., fingerprint: str | None = None) -> Any: ...


def make_idempotent(
    get_outbox: Callable[[], _UnitOfWorkSource],
    key: str | Callable[..., str],
    scope: str,
    fingerprint: Callable[..., str | None] | None,
    *,
    is_async: bool | None = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The ``@idempotent`` decorator on the outbox ``get_outbox()`` returns.

    ``is_async`` is the flavour of that outbox (``None``: not known until the call): an
    ``async def`` needs an ``AsyncOutbox`` and a plain function an ``Outbox``.
    """

    check_scope(scope)  # refused at decoration time, not at the first call
    if fingerprint is not None and not callable(fingerprint):
        raise ConfigurationError(
            f"@idempotent fingerprint must be a callable or None, got {type(fingerprint).__name__}"
        )

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(func):
            raise ConfigurationError(f"@idempotent decorates a function, got {type(func).__name__}")
        coroutine = inspect.iscoroutinefunction(func)
        if is_async is not None and coroutine != is_async:
            raise ConfigurationError(
                f"@idempotent on {func.__qualname__}: "
                + (
                    "an async def needs an AsyncOutbox"
                    if coroutine
                    else "a plain function needs an Outbox (use async def with AsyncOutbox)"
                )
            )
        try:
            signature = inspect.signature(func)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"@idempotent cannot read the signature of {func!r}") from exc
        params = list(signature.parameters)
        if not params:
            raise ConfigurationError(
                f"@idempotent function {func.__qualname__} must take the unit of work as its "
                "first parameter: def handler(uow, ...)"
            )
        if isinstance(key, str):
            if key not in params[1:]:
                raise ConfigurationError(
                    f"@idempotent(key={key!r}): {func.__qualname__} has no parameter {key!r}; "
                    "pass a parameter name or a callable taking the function's arguments"
                )
            key_param = key

            def key_of(*args: Any, **kwargs: Any) -> str:
                bound = signature.bind(None, *args, **kwargs)
                bound.apply_defaults()
                value: str = bound.arguments[key_param]
                return value

        elif callable(key):
            key_of = key
        else:
            raise ConfigurationError(
                f"@idempotent key must be a parameter name or a callable, got {key!r}"
            )

        if coroutine:

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                ob = get_outbox()
                fp = fingerprint(*args, **kwargs) if fingerprint is not None else None
                attempt = ob.unit_of_work(key_of(*args, **kwargs), scope=scope, fingerprint=fp)
                async with attempt as uow:
                    if uow.replayed:
                        return uow.result
                    value = await func(uow, *args, **kwargs)
                    uow.result = value
                    return value

            return async_wrapper

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            ob = get_outbox()
            fp = fingerprint(*args, **kwargs) if fingerprint is not None else None
            with ob.unit_of_work(key_of(*args, **kwargs), scope=scope, fingerprint=fp) as uow:
                if uow.replayed:
                    return uow.result
                value = func(uow, *args, **kwargs)
                uow.result = value
                return value

        return wrapper

    return decorate
