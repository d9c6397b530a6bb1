"""Typed results: ``uow.result`` values beyond plain JSON, given a declared type.

Invariant: what commits replays equal to what the handler returned, of the same types all the
way down, whether the replay was read from PostgreSQL or Redis. A declared type is compiled
once, when it is declared, into a :class:`Shape` tree; a type the rules cannot bring back
exactly (``set``, ``complex``, a union whose members JSON cannot tell apart, ...) is refused
there with a :class:`~outbox.errors.ConfigurationError`. Before commit, :meth:`TypedResult.encode`
checks the result against its shape to the depth the type declares (a ``datetime`` where a
``date`` is declared, ``True`` where an ``int`` is, a ``float`` inside ``list[Decimal]``: each
refused with where it sits), turns it into plain JSON data, and decodes that data once more to
check that the replay would be equal (``__post_init__`` or validators that change values, a
local time in a fold). :meth:`TypedResult.decode` turns stored data back into the declared type
after it was read.

Supported: pydantic models (``model_dump(mode="json")`` / ``model_validate``, by duck typing:
pydantic is not imported here), dataclasses (field by field, by their type hints), enums of
``str`` or ``int`` values, ``Literal`` of ``str``, ``int``, ``bool`` or ``None``, ``Decimal``
and ``UUID`` (as text), ``datetime`` and ``date`` (ISO 8601), ``str``, ``int``, ``float`` (an
``int`` is accepted and replays as the equal ``float``), ``bool``, ``None``, ``Any`` (plain JSON
data), and ``list``, ``tuple``, ``dict`` (keys ``str``, ``int``, ``UUID``, ``Decimal``, or a
``str`` enum or ``Literal``), ``Optional`` and unions of those whose members JSON tells apart
(at most one that is text, one number, one array, one object). A ``ResultCodec`` (any object
with ``encode(value)`` and ``decode(data)``) replaces the rules for types of other kinds.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import decimal
import enum
import math
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


class Mismatch(Exception):
    """A value that does not conform to its declared shape (``where`` names its place)."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where} {why}")


# The JSON kinds data comes back as; a union's members must not share one (see _union).
_NULL, _BOOL, _INT, _FLOAT, _TEXT = "null", "bool", "int", "float", "text"
_ARRAY, _OBJECT = "array", "object"
_ALL_KINDS = frozenset((_NULL, _BOOL, _INT, _FLOAT, _TEXT, _ARRAY, _OBJECT))


def _kind(data: Any) -> str:
    if data is None:
        return _NULL
    if isinstance(data, bool):
        return _BOOL
    if isinstance(data, int):
        return _INT
    if isinstance(data, float):
        return _FLOAT
    if isinstance(data, str):
        return _TEXT
    return _ARRAY if isinstance(data, list) else _OBJECT


def _name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else repr(tp)


def _a(value: Any) -> str:
    return f"a {type(value).__name__}"


class Shape:
    """How values of one declared type are checked, encoded and decoded."""

    kinds: frozenset[str] = _ALL_KINDS

    def check(self, value: Any, where: str) -> None:
        """Raise :class:`Mismatch` unless ``value`` replays as itself under this shape."""

    def encode(self, value: Any) -> Any:
        return value

    def decode(self, data: Any) -> Any:
        return data


class _Plain(Shape):
    """``Any``: data that JSON brings back as it is (no tuples, no Decimal...)."""

    def check(self, value: Any, where: str) -> None:
        if value is None or type(value) in (str, int, bool, float):
            return  # (the stored form keeps a float's exact text: outbox._core.results)
        if type(value) is list:
            for i, item in enumerate(value):
                self.check(item, f"{where}[{i}]")
            return
        if type(value) is dict:
            for k, item in value.items():
                if type(k) is not str:
                    raise Mismatch(f"{where} key {k!r}", "is not a str; declare the key type")
                self.check(item, f"{where}[{k!r}]")
            return
        raise Mismatch(where, f"is {_a(value)}, which plain JSON data cannot bring back; "
                       "declare its type")  # fmt: skip


class _Exact(Shape):
    """``str``, ``int``, ``bool``, ``None``: the value itself."""

    def __init__(self, tp: type, kind: str) -> None:
        self.tp, self.kinds = tp, frozenset((kind,))

    def check(self, value: Any, where: str) -> None:
        if type(value) is not self.tp:
            raise Mismatch(where, f"is {_a(value)}, but its declared type is {_name(self.tp)}")


class _Float(Shape):
    kinds = frozenset((_INT, _FLOAT))

    def check(self, value: Any, where: str) -> None:
        if type(value) is int and float(value) == value:
            return
        if type(value) is not float:
            raise Mismatch(where, f"is {_a(value)}, but its declared type is float")
        if not math.isfinite(value):
            raise Mismatch(where, f"is {value!r}, which JSON cannot store")

    def decode(self, data: Any) -> Any:
        return float(data)


class _Text(Shape):
    """``Decimal``, ``UUID``, ``datetime``, ``date``: text, parsed back."""

    kinds = frozenset((_TEXT,))

    def __init__(self, tp: type) -> None:
        self.tp = tp

    def check(self, value: Any, where: str) -> None:
        if type(value) is not self.tp:
            raise Mismatch(where, f"is {_a(value)}, but its declared type is {self.tp.__name__}")
        if isinstance(value, decimal.Decimal) and value.is_nan():
            raise Mismatch(where, "is a Decimal NaN, which equals nothing (not even its replay)")

    def encode(self, value: Any) -> Any:
        return value.isoformat() if isinstance(value, _dt.date) else str(value)

    def decode(self, data: Any) -> Any:
        if self.tp is _dt.datetime:
            return _dt.datetime.fromisoformat(data)
        if self.tp is _dt.date:
            return _dt.date.fromisoformat(data)
        return self.tp(data)


class _Enum(Shape):
    def __init__(self, tp: type[enum.Enum], where: str) -> None:
        values = [member.value for member in tp]
        if not values or any(type(v) not in (str, int) for v in values):
            raise _unsupported(tp, where, "an enum is supported when its values are str or int")
        self.tp, self.kinds = tp, frozenset(_kind(v) for v in values)

    def check(self, value: Any, where: str) -> None:
        if type(value) is not self.tp:
            raise Mismatch(where, f"is {_a(value)}, but its declared type is {self.tp.__name__}")

    def encode(self, value: Any) -> Any:
        return value.value

    def decode(self, data: Any) -> Any:
        return self.tp(data)


class _Literal(Shape):
    def __init__(self, tp: Any, where: str) -> None:
        self.values: tuple[Any, ...] = typing.get_args(tp)
        if any(v is not None and type(v) not in (str, int, bool) for v in self.values):
            raise _unsupported(tp, where, "a Literal is supported with str, int, bool or None")
        self.kinds = frozenset(_kind(v) for v in self.values)

    def check(self, value: Any, where: str) -> None:
        if not any(type(value) is type(v) and value == v for v in self.values):
            raise Mismatch(where, f"is {value!r}, not one of {list(self.values)!r}")


class _List(Shape):
    kinds = frozenset((_ARRAY,))

    def __init__(self, item: Shape) -> None:
        self.item = item

    def check(self, value: Any, where: str) -> None:
        if type(value) is not list:
            raise Mismatch(where, f"is {_a(value)}, but its declared type is a list")
        for i, item in enumerate(value):
            self.item.check(item, f"{where}[{i}]")

    def encode(self, value: Any) -> Any:
        return [self.item.encode(item) for item in value]

    def decode(self, data: Any) -> Any:
        return [self.item.decode(item) for item in data]


class _Tuple(Shape):
    """``tuple[X, ...]`` (``items`` None, ``rest`` X) or ``tuple[X, Y]`` (``items``)."""

    kinds = frozenset((_ARRAY,))

    def __init__(self, items: list[Shape] | None, rest: Shape | None) -> None:
        self.items, self.rest = items, rest

    def _shapes(self, n: int) -> list[Shape]:
        if self.items is not None:
            return self.items
        assert self.rest is not None
        return [self.rest] * n

    def check(self, value: Any, where: str) -> None:
        if type(value) is not tuple:
            raise Mismatch(where, f"is {_a(value)}, but its declared type is a tuple")
        if self.items is not None and len(value) != len(self.items):
            raise Mismatch(where, f"has {len(value)} items where its declared type has "
                           f"{len(self.items)}")  # fmt: skip
        for i, (item, shape) in enumerate(zip(value, self._shapes(len(value)), strict=True)):
            shape.check(item, f"{where}[{i}]")

    def encode(self, value: Any) -> Any:
        return [s.encode(v) for v, s in zip(value, self._shapes(len(value)), strict=True)]

    def decode(self, data: Any) -> Any:
        return tuple(s.decode(v) for v, s in zip(data, self._shapes(len(data)), strict=True))


# Dict keys become JSON object keys (text): the key types whose text parses back exactly.
_KEY_TYPES = (str, int, uuid.UUID, decimal.Decimal)


class _Dict(Shape):
    kinds = frozenset((_OBJECT,))

    def __init__(self, key: Shape, value: Shape) -> None:
        self.key, self.value = key, value

    def check(self, value: Any, where: str) -> None:
        if type(value) is not dict:
            raise Mismatch(where, f"is {_a(value)}, but its declared type is a dict")
        for k, item in value.items():
            self.key.check(k, f"{where} key {k!r}")
            self.value.check(item, f"{where}[{k!r}]")

    def encode(self, value: Any) -> Any:
        return {str(self.key.encode(k)): self.value.encode(v) for k, v in value.items()}

    def decode(self, data: Any) -> Any:
        # An int key is JSON text too, parsed back here (the key's own shape keeps ints as is).
        key = int if isinstance(self.key, _Exact) and self.key.tp is int else self.key.decode
        return {key(k): self.value.decode(v) for k, v in data.items()}


class _Dataclass(Shape):
    kinds = frozenset((_OBJECT,))

    def __init__(self, tp: type, where: str) -> None:
        try:
            hints = typing.get_type_hints(tp)
        except Exception as exc:  # a forward reference that does not resolve
            raise _unsupported(tp, where, f"its type hints do not resolve ({exc})") from None
        self.tp = tp
        self.fields: dict[str, Shape] = {}
        for field in dataclasses.fields(tp):
            if not field.init:
                raise _unsupported(tp, where, f"field {field.name!r} is not an __init__ argument")
            self.fields[field.name] = compile_shape(hints[field.name], f"{where}.{field.name}")

    def check(self, value: Any, where: str) -> None:
        if type(value) is not self.tp:
            raise Mismatch(where, f"is {_a(value)}, but its declared type is {self.tp.__name__}")
        for name, shape in self.fields.items():
            shape.check(getattr(value, name), f"{where}.{name}")

    def encode(self, value: Any) -> Any:
        return {name: shape.encode(getattr(value, name)) for name, shape in self.fields.items()}

    def decode(self, data: Any) -> Any:
        return self.tp(**{name: self.fields[name].decode(item) for name, item in data.items()})


class _Model(Shape):
    """A pydantic model: its own JSON mode both ways (checked by the round trip)."""

    kinds = frozenset((_OBJECT,))

    def __init__(self, tp: Any) -> None:
        self.tp = tp

    def check(self, value: Any, where: str) -> None:
        if type(value) is not self.tp:
            raise Mismatch(where, f"is {_a(value)}, but its declared type is {self.tp.__name__}")

    def encode(self, value: Any) -> Any:
        return value.model_dump(mode="json")

    def decode(self, data: Any) -> Any:
        return self.tp.model_validate(data)


class _Union(Shape):
    def __init__(self, tp: Any, members: list[Shape]) -> None:
        self.name, self.members = _name(tp), members
        self.kinds = frozenset().union(*(m.kinds for m in members))

    def _member(self, kind: str) -> Shape | None:
        for member in self.members:
            if kind in member.kinds:
                return member
        return None

    def _of(self, value: Any, where: str) -> Shape:
        # A value's JSON kind picks the member (the members' kinds are disjoint); encode()
        # gives each member's encoding of the value, so this is the member decode() will pick.
        for member in self.members:
            try:
                member.check(value, where)
            except Mismatch:
                continue
            return member
        raise Mismatch(where, f"is {_a(value)} ({value!r:.60}), which no member of its "
                       f"declared type {self.name} accepts")  # fmt: skip

    def check(self, value: Any, where: str) -> None:
        self._of(value, where)

    def encode(self, value: Any) -> Any:
        return self._of(value, "the result").encode(value)

    def decode(self, data: Any) -> Any:
        member = self._member(_kind(data))
        if member is None:
            raise ValueError(f"{_kind(data)} data matches no member of the union")
        return member.decode(data)


def _unsupported(tp: Any, where: str, why: str = "") -> ConfigurationError:
    return ConfigurationError(
        f"result type {_name(tp)} ({where}) is not supported{': ' + why if why else ''}: use a "
        "pydantic model, a dataclass, an enum, Literal, Decimal, UUID, datetime, date, plain "
        "JSON types, or list/tuple/dict/Optional/unions of them -- or pass result_codec= with "
        "encode(value) and decode(data)"
    )


def _union(tp: Any, where: str) -> Shape:
    members = [compile_shape(arg, where) for arg in typing.get_args(tp)]
    if any(isinstance(m, _Plain) for m in members):
        if all(isinstance(m, _Plain) or m.kinds == {_NULL} for m in members):
            return _Plain()  # Optional[Any] is Any
        raise _unsupported(tp, where, "Any in a union leaves nothing to tell its members apart")
    seen: dict[str, Shape] = {}
    for member in members:
        for kind in member.kinds:
            if kind in seen:
                raise _unsupported(
                    tp, where, f"two of its members are stored as JSON {kind} and a replay "
                    "could not tell which one it was; declare a model or dataclass per case",
                )  # fmt: skip
            seen[kind] = member
    return _Union(tp, members)


def _key_shape(tp: Any, where: str) -> Shape:
    shape = compile_shape(tp, where)
    if isinstance(shape, _Literal | _Enum) and shape.kinds == {_TEXT}:
        return shape
    if isinstance(shape, _Exact | _Text) and shape.tp in _KEY_TYPES:
        return shape
    raise _unsupported(tp, f"{where} key", "dict keys are str, int, UUID, Decimal, a str enum "
                       "or a str Literal (JSON keys are text)")  # fmt: skip


def compile_shape(tp: Any, where: str = "result_type") -> Shape:
    """The shape of a declared type; :class:`ConfigurationError` for a type the rules cannot
    bring back exactly."""
    if tp is Any:
        return _Plain()
    if tp is None or tp is type(None):
        return _Exact(type(None), _NULL)
    supertype = getattr(tp, "__supertype__", None)  # typing.NewType
    if supertype is not None:
        return compile_shape(supertype, where)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return compile_shape(args[0], where)
    if origin is typing.Literal:
        return _Literal(tp, where)
    if origin in (typing.Union, types.UnionType):
        return _union(tp, where)
    if origin is list:
        return _List(compile_shape(args[0], f"{where} item") if args else _Plain())
    if origin is tuple:
        if not args:  # typing.Tuple
            return _Tuple(None, _Plain())
        if len(args) == 2 and args[1] is Ellipsis:
            return _Tuple(None, compile_shape(args[0], f"{where} item"))
        return _Tuple([compile_shape(a, f"{where}[{i}]") for i, a in enumerate(args)], None)
    if origin is dict:
        key_tp, value_tp = args if args else (str, Any)
        return _Dict(_key_shape(key_tp, where), compile_shape(value_tp, f"{where} value"))
    if origin is not None or not isinstance(tp, type):
        raise _unsupported(tp, where)
    if tp is list:
        return _List(_Plain())
    if tp is tuple:
        return _Tuple(None, _Plain())
    if tp is dict:
        return _Dict(_Exact(str, _TEXT), _Plain())
    if issubclass(tp, enum.Enum):
        return _Enum(tp, where)
    exact = {str: _TEXT, int: _INT, bool: _BOOL}
    if tp in exact:
        return _Exact(tp, exact[tp])
    if tp is float:
        return _Float()
    if tp in (decimal.Decimal, uuid.UUID, _dt.datetime, _dt.date):
        return _Text(tp)
    if callable(getattr(tp, "model_validate", None)) and callable(getattr(tp, "model_dump", None)):
        return _Model(tp)
    if dataclasses.is_dataclass(tp):
        return _Dataclass(tp, where)
    raise _unsupported(tp, where)


class TypedResult:
    """The codec of one declared result type (or of a caller's :class:`ResultCodec`)."""

    __slots__ = ("_codec", "_shape", "name")

    def __init__(self, result_type: Any = None, codec: ResultCodec | None = None) -> None:
        self._codec = codec
        self._shape: Shape | None = None
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
            self._shape = compile_shape(result_type)
        self.name = _name(result_type)

    def encode(self, value: Any) -> Any:
        """JSON data for ``value``; refuses a value that would not replay equal to itself."""
        if self._codec is not None:
            try:
                return self._codec.encode(value)
            except SerializationError:
                raise
            except Exception as exc:
                raise SerializationError(f"result_codec.encode refused the result: {exc}") from exc
        shape = self._shape
        assert shape is not None
        try:
            shape.check(value, "the result")
        except Mismatch as exc:
            raise SerializationError(f"{exc}: a replay would not return the same value") from None
        except RecursionError:
            raise SerializationError("the result is nested too deeply to be stored") from None
        data = shape.encode(value)
        # The replay's own path, once: what a value's __post_init__, a model's validators or a
        # local time in a fold would make of the stored data.
        try:
            again = shape.decode(data)
        except Exception as exc:
            raise SerializationError(
                f"the result's stored form does not decode as {self.name} "
                f"({type(exc).__name__}: {exc}): a replay would fail"
            ) from exc
        if again != value:
            raise SerializationError(
                f"the result would replay as {again!r:.200}, not equal to what was returned "
                f"({value!r:.200}); declare a type whose values come back exactly"
            )
        return data

    def decode(self, data: Any) -> Any:
        """The declared value of stored JSON ``data``."""
        try:
            if self._codec is not None:
                return self._codec.decode(data)
            assert self._shape is not None
            return self._shape.decode(data)
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
