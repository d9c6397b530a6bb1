"""Database and Redis URLs, checked before any connection is attempted.

A URL the drivers would read differently from what its author meant -- a password with an
unencoded ``@`` or ``%``, a port that is not a number, a stray space or control character -- is
refused with a :class:`~outbox.errors.ConfigurationError` that says what to fix and never
quotes the URL's secrets (docs/concepts.md I9, I10): the drivers' own errors for such URLs would
echo parts of the password.

The database URL grammar is SQLAlchemy's (``make_url``); the Redis URL grammar is redis-py's
(``urllib.parse``). Both are stricter here: a URL is accepted only when the two readings of
its user name and password agree, which is what percent-encoding guarantees.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

from outbox.errors import ConfigurationError

MAX_URL_LENGTH = 4096
DATABASE_SCHEMES = ("postgresql+psycopg", "postgresql", "postgres")
REDIS_SCHEMES = ("redis", "rediss", "unix")

# SQLAlchemy's URL grammar (sqlalchemy.engine.url._parse_url), anchored at both ends.
_SQLALCHEMY_URL = re.compile(
    r"""
    (?P<scheme>[\w+]+)://
    (?:(?P<username>[^:/]*)(?::(?P<password>[^@]*))?@)?
    (?:(?:\[(?P<ipv6host>[^/?]+)\]|(?P<host>[^/:?]+))?(?::(?P<port>[^/?]*))?)?
    (?:/(?P<database>[^?]*))?
    (?:\?(?P<query>.*))?
    """,
    re.X | re.S,
)
_HOST = re.compile(r"[A-Za-z0-9._~%-]+")
_IPV6 = re.compile(r"[0-9A-Fa-f:.%A-Za-z]+")
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_UNSAFE = re.compile(r"[\x00-\x20\x7f]")
_UNENCODED_AT = "the user name or password contains an unencoded '@' (write it as %40)"


_T = TypeVar("_T")


def _attempt(parse: Callable[[], _T]) -> _T | None:
    """``parse()``, or ``None`` when it raises: the refusal is then raised outside the
    ``except`` block, so no parser's message (which may quote the URL) rides along as the
    error's context."""
    try:
        return parse()
    except (ValueError, UnicodeError):
        return None


def _fail(what: str, problem: str, example: str) -> ConfigurationError:
    # Never the URL itself: a malformed URL cannot be redacted reliably.
    return ConfigurationError(f"invalid {what}: {problem}; expected {example}")


def _check_text(url: object, what: str, example: str) -> str:
    if not isinstance(url, str):
        raise _fail(what, f"got {type(url).__name__}, not a str", example)
    if not url:
        raise _fail(what, "it is empty", example)
    if len(url) > MAX_URL_LENGTH:
        raise _fail(what, f"it is longer than {MAX_URL_LENGTH} characters", example)
    if _UNSAFE.search(url):
        raise _fail(
            what,
            "it contains a space or control character (percent-encode it, e.g. a space as %20)",
            example,
        )
    if not url.isascii() and not _attempt(lambda: url.encode("utf-8")):
        raise _fail(what, "it is not valid UTF-8 text", example)
    if "://" not in url:
        raise _fail(what, "it does not start with a scheme and ://", example)
    return url


def _check_userinfo(part: str | None, what: str, field: str, example: str) -> None:
    """A user name or password: percent escapes well formed, and decoded still valid text."""
    if part is None:
        return
    if "@" in part:
        raise _fail(what, f"the {field} contains an unencoded '@' (write it as %40)", example)
    if _BAD_ESCAPE.search(part):
        raise _fail(
            what,
            f"the {field} contains a '%' that starts no %XX escape (write '%' as %25)",
            example,
        )
    decoded = _attempt(lambda: unquote(part, errors="strict")) if "%" in part else part
    if decoded is None:
        raise _fail(what, f"the {field} decodes to invalid UTF-8", example)
    if "\x00" in decoded:
        raise _fail(what, f"the {field} decodes to a NUL character", example)


def _check_port(port: str | None, what: str, example: str) -> None:
    if port is None or port == "":
        return
    if not port.isdigit() or not port.isascii() or not 1 <= int(port) <= 65535:
        raise _fail(what, "the port must be a number from 1 to 65535", example)


def check_database_url(url: object) -> str:
    """A PostgreSQL URL, normalized to the psycopg 3 driver (``postgresql+psycopg://``).

    Accepts ``postgres://``, ``postgresql://`` and ``postgresql+psycopg://``; raises
    :class:`ConfigurationError` for anything SQLAlchemy or libpq would misread.
    """
    example = "postgresql+psycopg://user:password@host:5432/dbname"
    what = "database URL"
    text = _check_text(url, what, example)
    scheme = text.split("://", 1)[0]
    if scheme not in DATABASE_SCHEMES:
        shown = scheme if re.fullmatch(r"[\w+.-]{1,40}", scheme) else "?"
        raise ConfigurationError(
            f"unsupported database URL scheme {shown!r}: outbox-kit needs PostgreSQL through "
            "psycopg 3 (postgresql+psycopg://...)"
        )
    match = _SQLALCHEMY_URL.fullmatch(text)
    if match is None:
        raise _fail(what, "it cannot be parsed", example)
    _check_userinfo(match["username"], what, "user name", example)
    _check_userinfo(match["password"], what, "password", example)
    host = match["host"]
    if host is not None and not _HOST.fullmatch(host):
        problem = (
            _UNENCODED_AT
            if "@" in host
            else "the host name contains characters a host name cannot have"
        )
        raise _fail(what, problem, example)
    if match["ipv6host"] is not None and not _IPV6.fullmatch(match["ipv6host"]):
        raise _fail(what, "the bracketed IPv6 host is malformed", example)
    _check_port(match["port"], what, example)
    database = match["database"]
    if database is not None:
        if "@" in database:
            raise _fail(what, "the user name or password contains an unencoded '/' or '@'", example)
        _check_userinfo(database, what, "database name", example)
    query = match["query"]
    if query:
        _check_query(query, what, example)
    if scheme != "postgresql+psycopg":
        return "postgresql+psycopg://" + text.split("://", 1)[1]
    return text


# libpq options that carry secrets: in a URL they would show in the engine's repr and logs.
_SECRET_OPTIONS = frozenset({"password", "sslpassword"})
# What redis-py reads from a URL's query string (anything else becomes a keyword argument the
# connection refuses at its first command).
REDIS_QUERY_OPTIONS = frozenset(
    {
        "db",
        "socket_timeout",
        "socket_connect_timeout",
        "socket_read_size",
        "socket_keepalive",
        "retry_on_timeout",
        "retry_on_error",
        "max_connections",
        "health_check_interval",
        "timeout",
        "protocol",
        "legacy_responses",
        "client_name",
        "username",
        "password",
    }
)
REDIS_TLS_QUERY_OPTIONS = frozenset(
    {
        "ssl_check_hostname",
        "ssl_include_verify_flags",
        "ssl_exclude_verify_flags",
        "ssl_min_version",
        "ssl_cert_reqs",
        "ssl_ca_certs",
        "ssl_ca_path",
        "ssl_certfile",
        "ssl_keyfile",
    }
)


def _check_query(
    query: str, what: str, example: str, allowed: frozenset[str] | None = None
) -> None:
    if "?" in query:
        raise _fail(what, "the query string holds a second '?' (write it as %3F)", example)
    if _BAD_ESCAPE.search(query):
        raise _fail(what, "the query string contains a '%' that starts no %XX escape", example)
    pairs = _attempt(
        lambda: parse_qsl(query, keep_blank_values=True, strict_parsing=True, errors="strict")
    )
    if pairs is None:
        raise _fail(what, "the query string is malformed (name=value&...)", example)
    for name, value in pairs:
        if "\x00" in name or "\x00" in value:
            raise _fail(what, "the query string decodes to a NUL character", example)
        if allowed is not None and name not in allowed:
            shown = name if re.fullmatch(r"\w{1,40}", name) else "(not shown)"
            raise _fail(what, f"the query option {shown} is not one the client reads", example)
        if what == "database URL" and name.lower() in _SECRET_OPTIONS:
            raise _fail(
                what,
                f"{name}= in the query string would show wherever the URL is shown; put the "
                "password in the user info (user:password@host), or pass secrets with "
                "engine_options={'connect_args': {...}}",
                example,
            )


def check_redis_url(url: object) -> str:
    """A Redis URL as redis-py reads it: ``redis://``, ``rediss://`` or ``unix://``."""
    example = "redis://[user:password@]host:6379/0"
    what = "Redis URL"
    text = _check_text(url, what, example)
    scheme = text.split("://", 1)[0]
    if scheme not in REDIS_SCHEMES:
        shown = scheme if re.fullmatch(r"[\w+.-]{1,40}", scheme) else "?"
        raise ConfigurationError(
            f"unsupported Redis URL scheme {shown!r}: use redis://, rediss:// or unix://"
        )
    split = _attempt(lambda: (urlsplit(text), urlsplit(text).port))
    if split is None:
        raise _fail(what, "its host or port cannot be parsed", example)
    parts, port = split
    netloc = parts.netloc
    if netloc.count("@") > 1:
        raise _fail(what, _UNENCODED_AT, example)
    userinfo, _, hostport = netloc.rpartition("@")
    if userinfo:
        user, _, password = userinfo.partition(":")
        _check_userinfo(user, what, "user name", example)
        _check_userinfo(password, what, "password", example)
    host = hostport.rsplit(":", 1)[0] if port is not None else hostport
    if scheme == "unix":
        if not parts.path:
            raise _fail(what, "a unix:// URL needs the socket's path", example)
        if "@" in parts.path:
            raise _fail(what, "the user name or password holds an unencoded '/' or '@'", example)
    else:
        if host and not (_HOST.fullmatch(host) or re.fullmatch(r"\[[0-9A-Fa-f:.]+\]", host)):
            raise _fail(what, "the host name contains characters a host name cannot have", example)
        if parts.path not in ("", "/") and not re.fullmatch(r"/\d{1,5}", parts.path):
            raise _fail(what, "the path must be the database number, e.g. /0", example)
    if parts.fragment:
        raise _fail(what, "it has a '#' fragment (percent-encode '#' as %23)", example)
    if parts.query:
        allowed = REDIS_QUERY_OPTIONS | (REDIS_TLS_QUERY_OPTIONS if scheme == "rediss" else set())
        _check_query(parts.query, what, example, frozenset(allowed))
    return text
