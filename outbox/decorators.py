"""``@idempotent``: run a function inside a unit of work, replay its result to duplicates."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from outbox.config import DEFAULT_SCOPE
from outbox.errors import ConfigurationError

if TYPE_CHECKING:
    from outbox.uow import Outbox

P = ParamSpec("P")
R = TypeVar("R")


def make_idempotent(
    get_outbox: Callable[[], Outbox],
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


def idempotent(
    key: str | Callable[..., str],
    *,
    scope: str = DEFAULT_SCOPE,
    fingerprint: Callable[..., str | None] | None = None,
    outbox: Outbox | None = None,
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
    the caller's arguments and returns the key. ``fingerprint`` is an optional callable of the
    same arguments returning a request fingerprint (reusing a key with another one raises
    :class:`~outbox.errors.KeyReuseError`). The return value must be JSON-serializable: it is
    stored and a duplicate gets its JSON form back (tuples come back as lists). ``outbox``
    defaults to the module-level default (:func:`outbox.configure`), looked up at call time.
    """
    from outbox.uow import default_outbox

    def resolve() -> Outbox:
        return outbox if outbox is not None else default_outbox()

    return make_idempotent(resolve, key, scope, fingerprint)
