"""How an ``@idempotent`` decorator reads its function: written once for the unit of work's
decorator (:mod:`outbox.decorators`) and the guard's (:mod:`outbox.guard`).

The decorated function takes the unit of work (or the guard's claim) as its first parameter and
the caller's arguments after it. ``key`` names one of the caller's parameters, or is a callable
of the caller's arguments that returns the key.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from outbox.errors import ConfigurationError


def check_flavour(
    func: Callable[..., Any], is_async: bool | None, sync_owner: str, async_owner: str
) -> bool:
    """Whether ``func`` is a coroutine function; refuses one of the other flavour than the
    decorating object (``is_async``; ``None``: not known yet)."""
    if not callable(func):
        raise ConfigurationError(f"@idempotent decorates functions, got {func!r}")
    coroutine = inspect.iscoroutinefunction(func)
    if is_async is not None and coroutine != is_async:
        name = getattr(func, "__qualname__", repr(func))
        if coroutine:
            raise ConfigurationError(
                f"@idempotent on {name}: an async def needs {async_owner}.idempotent"
            )
        raise ConfigurationError(
            f"@idempotent on {name}: a plain function needs {sync_owner}.idempotent "
            f"(use async def with {async_owner})"
        )
    return coroutine


def key_function(
    func: Callable[..., Any], key: str | Callable[..., str], first: str
) -> Callable[..., str]:
    """The function that finds the key among the caller's arguments (see the module).

    ``first`` names what the decorated function takes first (``uow``, ``claim``), for errors.
    """
    name = getattr(func, "__qualname__", repr(func))
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"@idempotent cannot read the signature of {name}") from exc
    params = list(signature.parameters)
    if not params:
        raise ConfigurationError(
            f"@idempotent function {name} must take the {first} as its first parameter: "
            f"def handler({first}, ...)"
        )
    if callable(key):
        return key
    if not isinstance(key, str) or key not in params[1:]:
        raise ConfigurationError(
            f"@idempotent(key={key!r}): {name} has no parameter {key!r} after the {first}; pass "
            "a parameter name or a callable taking the function's arguments"
        )

    def key_of(*args: Any, **kwargs: Any) -> str:
        bound = signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        value: str = bound.arguments[key]
        return value

    return key_of
