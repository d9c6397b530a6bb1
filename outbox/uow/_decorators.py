"""``@idempotent``: run a function inside a unit of work, replay its result to duplicates.

Invariant: the wrapped function runs only inside the unit of work of the key its arguments
name, and its return value is that unit of work's result; a duplicate returns the stored result
without calling it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal, Protocol

from outbox._core.decorating import arguments_fingerprint, arguments_key, check_decorated_flavour
from outbox._core.typed_results import ResultCodec, typed_result
from outbox._core.validate import check_scope
from outbox.errors import ConfigurationError


class _UnitOfWorkSource(Protocol):
    """What the decorator needs of an outbox: units of work (``Outbox`` is one)."""

    def unit_of_work(
        self,
        key: str,
        scope: str = ...,
        fingerprint: str | None = None,
        *,
        result_type: Any = ...,
        result_codec: ResultCodec | None = ...,
    ) -> Any: ...


def make_idempotent(
    get_outbox: Callable[[], _UnitOfWorkSource],
    key: str | Callable[..., str],
    scope: str,
    fingerprint: Callable[..., str | None] | Literal[False] | None,
    *,
    is_async: bool | None = False,
    result_type: Any = None,
    result_codec: ResultCodec | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The ``@idempotent`` decorator on the outbox ``get_outbox()`` returns.

    ``is_async`` is the flavour of that outbox (``None``: not known until the call): an
    ``async def`` needs an ``AsyncOutbox`` and a plain function an ``Outbox``. ``fingerprint``
    ``None`` fingerprints the caller's arguments; ``False`` compares keys only.
    ``result_type`` / ``result_codec``: see :meth:`outbox.Outbox.unit_of_work`.
    """

    check_scope(scope)  # refused at decoration time, not at the first call
    typed_result(result_type, result_codec)  # likewise an unsupported result type
    declared = {"result_type": result_type, "result_codec": result_codec}
    if fingerprint is not None and fingerprint is not False and not callable(fingerprint):
        raise ConfigurationError(
            "@idempotent fingerprint must be a callable, None (the arguments) or False (none), "
            f"got {type(fingerprint).__name__}"
        )

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        coroutine = check_decorated_flavour(func, is_async, "Outbox", "AsyncOutbox")
        key_of = arguments_key(func, key, "uow")
        fingerprint_of = (
            arguments_fingerprint(func) if fingerprint is None else (fingerprint or None)
        )

        if coroutine:

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                ob = get_outbox()
                fp = fingerprint_of(*args, **kwargs) if fingerprint_of is not None else None
                attempt = ob.unit_of_work(
                    key_of(*args, **kwargs), scope=scope, fingerprint=fp, **declared
                )
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
            fp = fingerprint_of(*args, **kwargs) if fingerprint_of is not None else None
            attempt = ob.unit_of_work(
                key_of(*args, **kwargs), scope=scope, fingerprint=fp, **declared
            )
            with attempt as uow:
                if uow.replayed:
                    return uow.result
                value = func(uow, *args, **kwargs)
                uow.result = value
                return value

        return wrapper

    return decorate
