"""Secret redaction, written once: URLs, librdkafka secrets and one-line error texts.

Passwords in URLs and SASL/TLS secrets must never reach logs, errors, ``repr``, metrics or
health output, also when the input is malformed (docs/concepts.md I10). Every message that may
quote a URL or a Kafka setting goes through these functions, and none of them raises.

The rules are deliberately conservative: when a URL cannot be read unambiguously, more is
hidden rather than less. In a URL everything between the user name's ``:`` and the *last*
``@`` counts as the password (an unencoded ``@`` in a password cannot leak its tail), and the
values of query parameters named like a secret (``password=``, ``sslpassword=`` ...) are
hidden as well. A librdkafka property is secret when its name says so: ``*password*``,
``*secret*``, ``*token*``, ``*credential*``, ``sasl.*``, ``ssl.key.*``, ``*.key.pem``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import unquote

HIDDEN = "***"

_SECRET_WORDS = ("password", "passwd", "secret", "token", "credential")
_SECRET_PREFIXES = ("sasl.", "ssl.key.", "ssl_key")
# Query parameters (and key=value words of a libpq DSN) whose values are secrets. In a URL the
# value runs to the next "&" (a malformed one may hold spaces or "#"); in free text, to the
# next space as well.
_SECRET_NAME = r"(?i)((?:^|[?&;\s])[\w.-]*(?:password|passwd|pwd|secret|token|sslkey)[\w.-]*=)"
_SECRET_PARAM = re.compile(_SECRET_NAME + r"([^&;\s]*)")
_SECRET_PARAM_IN_URL = re.compile(_SECRET_NAME + r"([^&]*)")
_SHORT = 4  # shorter secrets are hidden only where they stand alone, not inside other words


def _userinfo_span(url: str) -> tuple[int, int] | None:
    """Where the password of ``url`` sits (start, end), read conservatively: from the first
    ``:`` after the scheme's ``//`` (or the start) to the last ``@``."""
    start = url.find("://")
    start = 0 if start < 0 else start + 3
    at = url.rfind("@")
    if at < start:
        return None
    colon = url.find(":", start, at)
    if colon < 0:
        return None
    return colon + 1, at


def redact_url(url: object) -> str:
    """``url`` with its password (and secret query parameters) replaced by ``***``.

    Safe for logs and errors whatever ``url`` holds: a value that is not a URL at all has
    everything after its first ``:`` hidden.
    """
    if not isinstance(url, str):
        return "<not a URL>"
    # Query secrets first: a password parameter may itself hold an "@".
    text = _SECRET_PARAM_IN_URL.sub(lambda m: m.group(1) + HIDDEN, url)
    span = _userinfo_span(text)
    if span is not None:
        text = text[: span[0]] + HIDDEN + text[span[1] :]
    elif "://" not in text and ":" in text:
        # Not a URL we can read: the part after a colon may be anything.
        text = text.split(":", 1)[0] + ":" + HIDDEN
    return text


def url_secrets(url: object) -> list[str]:
    """Every text that may be ``url``'s password, as written and percent-decoded, whichever
    way a driver reads the URL; and the values of its secret query parameters."""
    if not isinstance(url, str):
        return []
    found: set[str] = set()
    span = _userinfo_span(url)
    if span is not None:
        found.add(url[span[0] : span[1]])
    # SQLAlchemy's reading: the password ends at the first "@" after it.
    rest = url.split("://", 1)[-1]
    userinfo = rest.split("@", 1)[0] if "@" in rest else ""
    if ":" in userinfo:
        found.add(userinfo.split(":", 1)[1])
    for match in _SECRET_PARAM_IN_URL.finditer(url):
        found.add(match.group(2))
    for value in list(found):
        found.add(unquote(value))
    return sorted((s for s in found if s), key=len, reverse=True)


def is_secret_setting(name: object) -> bool:
    """True for a librdkafka property whose value must not be shown (passwords, keys...)."""
    if not isinstance(name, str):
        return True
    lowered = name.lower()
    return (
        any(word in lowered for word in _SECRET_WORDS)
        or lowered.startswith(_SECRET_PREFIXES)
        or lowered.endswith("key.pem")
    )


def redact_kafka_config(config: Mapping[Any, Any]) -> dict[Any, Any]:
    """A copy of ``config`` with every secret value replaced by ``***`` (for ``repr``)."""
    return {name: HIDDEN if is_secret_setting(name) else value for name, value in config.items()}


def _kafka_secrets(config: Mapping[Any, Any] | None) -> Iterator[str]:
    for name, value in (config or {}).items():
        if is_secret_setting(name) and isinstance(value, str) and value:
            yield value


def hide(text: str, secrets: Iterable[str]) -> str:
    """Replace every occurrence of each secret in ``text`` with ``***`` (secrets shorter than
    four characters only where they stand alone, so that short values do not shred a message).
    """
    for secret in sorted(set(secrets), key=len, reverse=True):
        if not secret or secret == HIDDEN:
            continue
        if len(secret) >= _SHORT:
            text = text.replace(secret, HIDDEN)
        else:
            text = re.sub(rf"(?<![\w]){re.escape(secret)}(?![\w])", HIDDEN, text)
    return text


def redact(
    text: str,
    *,
    urls: Iterable[str | None] = (),
    kafka_config: Mapping[str, object] | None = None,
) -> str:
    """Hide in ``text`` the passwords of ``urls`` and the secret values of ``kafka_config``."""
    secrets: list[str] = []
    for url in urls:
        if url:
            text = text.replace(url, redact_url(url))
            secrets.extend(url_secrets(url))
    secrets.extend(_kafka_secrets(kafka_config))
    return hide(text, secrets)


_URL_START = re.compile(r"[A-Za-z][\w+.-]*://")
_SETTING = re.compile(r"([A-Za-z0-9][\w.-]*)=([^\s,'\"]*)")


def redact_text(text: str) -> str:
    """Hide secrets in free text whose inputs are not known (an argparse error quoting the
    command line, say): the password of every URL in it -- read to the last ``@`` of the
    text, since a malformed password may hold spaces or line breaks -- and the value of every
    ``name=value`` whose name is a secret setting's."""
    text = _SECRET_PARAM.sub(lambda m: m.group(1) + HIDDEN, text)
    for match in reversed(list(_URL_START.finditer(text))):
        start = match.start()
        text = text[:start] + redact_url(text[start:])
    return _SETTING.sub(
        lambda m: f"{m.group(1)}={HIDDEN}" if is_secret_setting(m.group(1)) else m.group(0), text
    )


_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")


def _visible(line: str) -> str:
    """``line`` with control characters (a terminal's escape sequences, a stray carriage
    return) shown as ``\\xNN`` escapes: what reaches a log is one line of plain text."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", line)


def one_line(
    exc: BaseException,
    *,
    urls: Iterable[str | None] = (),
    kafka_config: Mapping[str, object] | None = None,
    with_type: bool = True,
) -> str:
    """The first line of ``exc``'s message (of the driver's error under a SQLAlchemy wrapper),
    secrets redacted and control characters escaped, prefixed with the exception type unless
    ``with_type`` is false: never more than one line, whatever the message holds."""
    origin = getattr(exc, "orig", None)
    source = origin if isinstance(origin, BaseException) else exc
    try:
        lines = str(source).strip().splitlines()
    except Exception:  # a __str__ that fails must not hide the error being reported
        lines = []
    # Redacted before and after escaping: a URL given in ``urls`` is matched as it was given
    # (control characters and all), and whatever escaping reveals is redacted again.
    urls = tuple(urls)
    text = (
        redact(
            _visible(redact(lines[0], urls=urls, kafka_config=kafka_config)),
            urls=urls,
            kafka_config=kafka_config,
        )
        if lines
        else ""
    )
    if not with_type:
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
