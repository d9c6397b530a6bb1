"""How a stored result keeps its exact JSON text in PostgreSQL's ``jsonb`` column.

A duplicate must get the same JSON value, of the same Python types, whether Redis or PostgreSQL
answers it. Redis keeps the result's JSON text as written; ``jsonb`` does not: it keeps numbers
as ``numeric`` (``1e308`` comes back as a 309-digit integer, ``1e16`` as an ``int``, ``-0.0``
as ``0.0``) and sorts the keys of every object (by length, then bytes).

So a result is stored as plain ``jsonb`` only when ``jsonb`` gives its text back unchanged
(:func:`jsonb_keeps`: no float written with a positive exponent, no negative zero, object keys
already in ``jsonb``'s order -- scalars, lists, the HTTP door's responses), readable in SQL as
before. Any other result is stored as its exact JSON text inside a one-key object,
``{"outbox-kit:json": "<text>"}`` (:func:`for_database`), and unwrapped when read
(:func:`from_database`). Rows written before
this form existed are plain ``jsonb`` and read as they always were; a result that is itself an
object with the key ``outbox-kit:json`` is always wrapped, so a plain row never looks wrapped.
"""

from __future__ import annotations

import json
from typing import Any, Final

EXACT_KEY: Final = "outbox-kit:json"
# How PostgreSQL prints a wrapped row (jsonb's text output: ", " and ": " separators).
_WRAPPED_PREFIX: Final = '{"' + EXACT_KEY + '": '


def _before(a: str, b: str) -> bool:
    """Whether key ``a`` sorts strictly before ``b`` in ``jsonb`` (shorter first, then
    bytewise in UTF-8; ASCII keys compare as their bytes do without encoding them)."""
    if a.isascii() and b.isascii():
        return (len(a), a) < (len(b), b)
    raw_a, raw_b = a.encode("utf-8"), b.encode("utf-8")
    return (len(raw_a), raw_a) < (len(raw_b), raw_b)


def jsonb_keeps(value: Any) -> bool:
    """True when ``jsonb`` prints ``value``'s JSON text back as a text that parses to the same
    value, of the same types, with the same key order (see the module)."""
    if isinstance(value, dict) and EXACT_KEY in value:
        return False
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            text = float.__repr__(item)
            # numeric prints 1e+16 without an exponent or a point (an int to JSON readers),
            # and has no negative zero; 1e-05 comes back as 0.00001, a float of the same value.
            if "e+" in text or text == "-0.0":
                return False
        elif isinstance(item, dict):
            previous: str | None = None
            for key, child in item.items():
                if not isinstance(key, str):
                    return False  # json writes it as a string: let the exact text decide
                if previous is not None and not _before(previous, key):
                    return False
                previous = key
                stack.append(child)
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return True


def for_database(text: str, value: Any) -> str:
    """The ``jsonb`` text to store for a result whose exact JSON text is ``text``
    (``value`` is the result that ``text`` encodes)."""
    if value is None or jsonb_keeps(value):
        return text
    return '{"' + EXACT_KEY + '":' + json.dumps(text, ensure_ascii=False) + "}"


def from_database(stored: str | None) -> str | None:
    """The exact JSON text of a result read back from ``jsonb`` (``result::text``)."""
    if stored is None or not stored.startswith(_WRAPPED_PREFIX):
        return stored
    parsed = json.loads(stored)
    if isinstance(parsed, dict) and len(parsed) == 1:
        inner = parsed.get(EXACT_KEY)
        if isinstance(inner, str):
            return inner
    return stored


def decoded_from_database(stored: Any) -> Any:
    """The result of a ``jsonb`` value a driver already decoded (``SELECT result``)."""
    if isinstance(stored, dict) and len(stored) == 1:
        inner = stored.get(EXACT_KEY)
        if isinstance(inner, str):
            return json.loads(inner)
    return stored
