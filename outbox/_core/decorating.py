"""How an ``@idempotent`` decorator reads its function, for the unit of work and the guard alike.

Invariant: the same key with other arguments is a reuse, not a duplicate. The decorated function
takes the unit of work (or the guard's claim) first and the caller's arguments after it;
``key`` names one of the caller's parameters or is a callable of them, and without a
``fingerprint`` of its own a function's fingerprint covers all of the caller's arguments
(:func:`arguments_fingerprint`).
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import hashlib
import inspect
import json
import uuid
from collections.abc import Callable
from typing import Any

from outbox.errors import ConfigurationError


def check_decorated_flavour(
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


def arguments_key(
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


_EXACT = (decimal.Decimal, datetime.datetime, datetime.date, datetime.time, datetime.timedelta,
          uuid.UUID)  # fmt: skip


def _canonical(value: Any, where: str, name: str) -> Any:
    """``value`` as JSON-able data that compares equal exactly when the values do."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, enum.Enum):
        return {"enum": type(value).__qualname__, "value": _canonical(value.value, where, name)}
    if isinstance(value, _EXACT):
        return {type(value).__name__: str(value)}
    if isinstance(value, bytes | bytearray | memoryview):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, list | tuple):
        return [_canonical(v, where, name) for v in value]
    if isinstance(value, set | frozenset):
        items = [_canonical(v, where, name) for v in value]
        return {"set": sorted(items, key=lambda v: json.dumps(v, sort_keys=True))}
    if isinstance(value, dict):
        return {
            "dict": sorted(
                (
                    [_canonical(k, where, name), _canonical(v, where, name)]
                    for k, v in value.items()
                ),
                key=lambda kv: json.dumps(kv[0], sort_keys=True),
            )
        }
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {type(value).__qualname__: _canonical(dataclasses.asdict(value), where, name)}
    dump = getattr(value, "model_dump", None)  # a pydantic model
    if callable(dump):
        return {type(value).__qualname__: _canonical(dump(mode="json"), where, name)}
    raise ConfigurationError(
        f"@idempotent on {where}: argument {name!r} is a {type(value).__name__}, which has no "
        "stable fingerprint; pass fingerprint= a function of the arguments returning a str, or "
        "fingerprint=False to compare keys only"
    )


def arguments_fingerprint(func: Callable[..., Any]) -> Callable[..., str]:
    """The default fingerprint of a decorated function: a SHA-256 over the caller's arguments
    as bound to its signature (positional or keyword, defaults applied), so a call with the
    same key and other arguments raises :class:`~outbox.errors.KeyReuseError` instead of
    silently getting the first call's result. Arguments must be data (str, numbers, None,
    lists, tuples, dicts, sets, bytes, decimals, dates, UUIDs, enums, dataclasses, pydantic
    models); anything else is refused with :class:`ConfigurationError` before any I/O."""
    where = getattr(func, "__qualname__", repr(func))
    signature = inspect.signature(func)
    first = next(iter(signature.parameters))

    def fingerprint(*args: Any, **kwargs: Any) -> str:
        bound = signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        data = [
            [name, _canonical(value, where, name)]
            for name, value in bound.arguments.items()
            if name != first
        ]
        text = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=True)
        return "args:sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()

    return fingerprint
