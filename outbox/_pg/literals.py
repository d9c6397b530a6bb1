"""The toolkit's statements as text with their parameters as literals, for the simple query
protocol (several statements in one message), written for the session's settings.

Flavour-free: the sync and asyncio transactions (``transaction.py``, ``transaction_async.py``)
both send what this writes.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
import weakref
from typing import Any

import psycopg
from psycopg import pq

from outbox._pg.statements import Prepared
from outbox.errors import ValidationError

# libpq's escaping object of each driver connection.
_escaping: weakref.WeakKeyDictionary[psycopg.BaseConnection[Any], Any] = weakref.WeakKeyDictionary()


def execute_text(
    driver: psycopg.BaseConnection[Any],
    p: Prepared,
    params: dict[str, Any],
    *,
    inline: bool = False,
) -> bytes:
    """``EXECUTE name (...)`` with the parameters as literals escaped by libpq; with ``inline``,
    the statement's own text with the literals in place of its parameters (no server-side
    prepared statement: behind a transaction pooler a name PREPAREd in one transaction may be
    missing, or mean another statement, in the next).

    Sent with the simple query protocol, several statements travel in one message. Every
    literal is written for the session's settings as the server reported them: ASCII text
    escaped by PQescapeLiteral (text beyond ASCII, under a client encoding other than UTF-8,
    as :func:`_from_utf8` writes it); a bytea by PQescapeByteaConn, which knows
    ``standard_conforming_strings``; an array as one ``E''`` literal, which reads the same under
    either setting. (psycopg's own text form of a ``bytea[]`` is escaped for a literal, not for
    an array element, and comes out wrong under ``standard_conforming_strings = off``.)
    """
    escaping = _escaping.get(driver)
    if escaping is None:
        escaping = _escaping[driver] = pq.Escaping(driver.pgconn)
    codec = driver.info.encoding
    utf8 = codec == "utf-8"
    text, bytea = escaping.escape_literal, escaping.escape_bytea
    literals = []
    for name in p.args:
        # A unit of work's values are texts, ints, bytes, None and UUIDs: the common cases
        # here, every other one (and the same types under another encoding) by _literal.
        value = params[name]
        kind = type(value)
        if kind is str and utf8:
            literals.append(text(value.encode()))
        elif value is None:
            literals.append(b"NULL")
        elif kind is int:
            literals.append(b"%d" % value)
        elif kind is bytes:
            literals.append(b"'" + bytea(value) + b"'")
        else:
            literals.append(_literal(escaping, codec, value))
    if inline:
        texts, names = _inline_parts(p)
        by_name = dict(zip(p.args, literals, strict=True))
        out = [texts[0]]
        for name, piece in zip(names, texts[1:], strict=True):
            out += (by_name[name], piece)
        return b"".join(out)
    return b"EXECUTE " + p.name.encode() + b" (" + b", ".join(literals) + b")"


def _literal(escaping: Any, codec: str, value: Any) -> bytes:
    if value is None:
        return b"NULL"
    if isinstance(value, bool):
        return b"true" if value else b"false"
    if isinstance(value, int):
        return str(value).encode()
    if isinstance(value, str):
        if codec != "utf-8" and not value.isascii():
            return _from_utf8(value, "text")
        text: bytes = escaping.escape_literal(value.encode())
        return text
    if isinstance(value, bytes):
        escaped: bytes = escaping.escape_bytea(value)
        return b"'" + escaped + b"'"
    if isinstance(value, uuid.UUID):
        return b"'" + str(value).encode() + b"'"
    if isinstance(value, list):
        data = _array_text(value)
        if codec != "utf-8" and not data.isascii():
            return _from_utf8(data.decode(), "text[]")  # only text arrays hold non-ASCII
        array: bytes = escaping.escape_literal(data)
        return array
    raise TypeError(f"cannot bind {type(value).__name__} as a literal")


def _from_utf8(text: str, kind: str) -> bytes:
    """``text`` as an expression that reads the same under every client encoding: its UTF-8
    bytes in hex, converted by the server. Python's codecs and the server's conversion tables
    differ for some encodings (under SJIS Python writes U+00A5 as a backslash; under EUC_JP the
    server reads Python's U+00AC as U+FFE2), so text beyond ASCII never relies on them."""
    return f"CAST(convert_from(decode('{text.encode().hex()}', 'hex'), 'UTF8') AS {kind})".encode()


@functools.lru_cache(maxsize=1024)
def _inline_parts(p: Prepared) -> tuple[list[bytes], list[str]]:
    """The statement's text split around its ``%(name)s`` (or ``%(name)b``) parameters: texts
    and names."""
    pieces = _PARAMETER.split(p.direct)
    return [t.encode() for t in pieces[0::2]], pieces[1::2]


_PARAMETER = re.compile(r"%\((\w+)\)[sb]")


def _array_text(values: list[Any]) -> bytes:
    """A one-dimensional array in PostgreSQL's text form (``{"a",NULL,"\\x00"}``), in UTF-8,
    to be quoted as one literal; the server reads it as the parameter's array type. The
    elements are all of one type, or None."""
    kinds = set(map(type, values))
    kinds.discard(type(None))
    if kinds == {str} and not _CONTROL.search("".join(filter(None, values))):
        # Without control characters, JSON quotes strings exactly as an array literal does
        # (a backslash before each quote and backslash), and null reads as NULL.
        text = json.dumps(values, ensure_ascii=False, separators=(",", ":"))[1:-1]
    elif kinds <= {int, uuid.UUID} and None not in values:
        text = ",".join(map(str, values))
    else:
        elements = []
        for value in values:
            if value is None:
                elements.append("NULL")
            elif isinstance(value, bool):
                elements.append("t" if value else "f")
            elif isinstance(value, int | uuid.UUID):
                elements.append(str(value))
            elif isinstance(value, str):
                elements.append('"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"')
            elif isinstance(value, bytes):
                elements.append('"\\\\x' + value.hex() + '"')
            else:
                raise TypeError(f"cannot bind {type(value).__name__} in an array literal")
        text = ",".join(elements)
    return ("{" + text + "}").encode()


def untranslatable(exc: UnicodeEncodeError) -> ValidationError:
    """The error for a text that the driver could not write in the session's client encoding
    (a joined unit of work's statements are bound by the driver, as the caller's own are)."""
    text = exc.object if isinstance(exc.object, str) else ""
    shown = repr(text) if len(text) <= 40 else repr(text[:40]) + "..."
    return ValidationError(
        f"the text {shown} holds {text[exc.start : exc.start + 1]!r}, which the connection's "
        f"client_encoding (Python's {exc.encoding!r}) cannot carry; nothing was written. "
        "Connect with client_encoding=UTF8 (add ?client_encoding=utf8 to the database URL, "
        "or pass connect_args={'client_encoding': 'utf8'})"
    )


_CONTROL = re.compile("[\x00-\x1f]")
