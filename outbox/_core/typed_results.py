"""Typed results: ``uow.result`` values beyond plain JSON, given a declared type.

Invariant: every replay gives the same value, of the same type, whether it was read from
PostgreSQL or Redis: :meth:`TypedResult.encode` turns a value into plain JSON data before it is
stored, and :meth:`TypedResult.decode` turns the stored data back into the declared type after
it was read, whatever the JSON layer does with numbers.

Supported: pydantic models (``model_dump(mode="json")`` / ``model_validate``, by duck typing:
pydantic is not imported here), dataclasses (field by field, by their type hints),
``Decimal`` and ``UUID`` (as text), ``datetime`` and ``date`` (ISO 8601), ``str``, ``int``,
``float``, ``bool``, ``None``, and ``list``, ``tuple``, ``dict`` and ``Optional`` of those. A
``ResultCodec`` (any object with ``encode(value)`` and ``decode(data)``) replaces the rules
for types of other kinds.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import decimal
import types
import typing
import uuid
from typing import Any, Protocol

from outbox.errors import ConfigurationError, SerializationError


class ResultCodec(Protocol):
    """An output serializer: ``encode(value)`` returns JSON data (dict, list, str, number, bool,
    None) and ``decode(data)`` the value back."""

    def encode(self, value: Any) -> Any: ...

    def decode(self, data: Any) -> Any: ...


_SCALARS = (str, int, float, bool)
_TEXT = (decimal.Decimal, uuid.UUID)


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and callable(getattr(tp, "model_validate", None))


def _check(tp: Any, where: str) -> None:
    """Refuse a declared result type the rules cannot bring back (at declaration time)."""
    if tp is Any or tp is None or tp is type(None):
        return
    origin = typing.get_origin(tp)
    if origin is None:
        if isinstance(tp, type) and (
            issubclass(tp, (*_SCALARS, *_TEXT, _dt.date))
            or _is_model(tp)
            or dataclasses.is_dataclass(tp)
            or tp in (list, dict, tuple)
        ):
            if dataclasses.is_dataclass(tp):
                for name, hint in typing.get_type_hints(tp).items():
                    _check(hint, f"{where}.{name}")
            return
        raise ConfigurationError(
            f"result type {tp!r} ({where}) is not supported: use a pydantic model, a "
            "dataclass, Decimal, UUID, datetime, date, plain JSON types or list/dict/Optional "
            "of them -- or pass result_codec= with encode(value) and decode(data)"
        )
    if origin in (list, tuple, dict, typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is not Ellipsis:
                _check(arg, where)
        return
    raise ConfigurationError(f"result type {tp!r} ({where}) is not supported")


def encode(value: Any) -> Any:
    """Plain JSON data for ``value`` (see the module)."""
    if value is None or isinstance(value, _SCALARS):
        return value
    if isinstance(value, _TEXT):
        return str(value)
    if isinstance(value, _dt.date):  # datetime too
        return value.isoformat()
    dump = getattr(value, "model_dump", None)
    if callable(dump) and not isinstance(value, type):
        return dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [encode(item) for item in value]
    if isinstance(value, dict):
        return {_key(k): encode(v) for k, v in value.items()}
    return value  # refused with its type by the JSON encoder


def _key(key: Any) -> Any:
    return str(key) if isinstance(key, _TEXT) else key


def decode(data: Any, tp: Any) -> Any:
    """``data`` (as :func:`encode` wrote it) as a value of type ``tp``."""
    if tp is Any or tp is None:
        return data
    if tp is type(None):
        return None
    origin = typing.get_origin(tp)
    if origin is not None:
        return _decode_generic(data, tp, origin)
    if data is None:
        return None
    if _is_model(tp):
        return tp.model_validate(data)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp)
        return tp(**{name: decode(item, hints.get(name, Any)) for name, item in data.items()})
    if tp is bool or tp is str:
        return data
    if tp is float or tp is int or issubclass(tp, _TEXT):
        return tp(data)
    if issubclass(tp, _dt.datetime):
        return _dt.datetime.fromisoformat(data)
    if issubclass(tp, _dt.date):
        return _dt.date.fromisoformat(data)
    if tp is tuple:
        return tuple(data)
    return data


def _decode_generic(data: Any, tp: Any, origin: Any) -> Any:
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if data is None:
            return None
        options = [a for a in args if a is not type(None)]
        return decode(data, options[0]) if len(options) == 1 else data
    if data is None:
        return None
    if origin is list:
        return [decode(item, args[0] if args else Any) for item in data]
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode(item, args[0]) for item in data)
        return tuple(decode(item, arg) for item, arg in zip(data, args, strict=False))
    if origin is dict:
        key_type, value_type = args if args else (Any, Any)
        return {decode(k, key_type): decode(v, value_type) for k, v in data.items()}
    return data


class TypedResult:
    """The codec of one declared result type (or of a caller's :class:`ResultCodec`)."""

    __slots__ = ("_codec", "_type", "name")

    def __init__(self, result_type: Any = None, codec: ResultCodec | None = None) -> None:
        if codec is not None:
            if result_type is not None:
                raise ConfigurationError("pass result_type= or result_codec=, not both")
            if not callable(getattr(codec, "encode", None)) or not callable(
                getattr(codec, "decode", None)
            ):
                raise ConfigurationError(
                    "result_codec must have encode(value) -> JSON data and decode(data) -> value"
                )
        else:
            _check(result_type, "result_type")
        self._type = result_type
        self._codec = codec
        self.name = getattr(result_type, "__name__", repr(result_type))

    def encode(self, value: Any) -> Any:
        """JSON data for ``value``; refuses a value that is not of the declared type."""
        if self._codec is not None:
            try:
                return self._codec.encode(value)
            except SerializationError:
                raise
            except Exception as exc:
                raise SerializationError(f"result_codec.encode refused the result: {exc}") from exc
        tp = self._type
        mismatch = isinstance(tp, type) and value is not None and not isinstance(value, tp)
        if mismatch and not (tp is float and type(value) is int):
            raise SerializationError(
                f"the result is a {type(value).__name__}, but its declared type is "
                f"{self.name}: a replay would not return the same value"
            )
        return encode(value)

    def decode(self, data: Any) -> Any:
        """The declared value of stored JSON ``data``."""
        try:
            if self._codec is not None:
                return self._codec.decode(data)
            return decode(data, self._type)
        except Exception as exc:
            raise SerializationError(
                f"the stored result does not decode as {self.name} ({type(exc).__name__}: {exc});"
                " was the result type changed since the key was stored?"
            ) from exc


def typed_result(result_type: Any = None, codec: ResultCodec | None = None) -> TypedResult | None:
    """The codec for a declaration, or None when nothing was declared (plain JSON results)."""
    if result_type is None and codec is None:
        return None
    return TypedResult(result_type, codec)
