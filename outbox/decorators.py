"""``@idempotent``: run a function inside a unit of work, replay its result to duplicates.

The wrapping is written here once; :func:`outbox.idempotent` and :meth:`outbox.Outbox.idempotent`
(in :mod:`outbox.uow`) supply the outbox it runs on.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from outbox.errors import ConfigurationError


class _UnitOfWorkSource(Protocol):
    """What the decorator needs of an outbox: units of work (``Outbox`` is one)."""

    def unit_of_work(
        self, key: str, scope: str = ..., fingerprint: str | None = None
    ) -> AbstractContextManager[Any]: ...


def make_idempotent(
    get_outbox: Callable[[], _UnitOfWorkSource],
    key: str | Callable[..., str],
    scope: str,
    fingerprint: Callable[..., str | None] | None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(func)
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
