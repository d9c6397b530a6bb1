"""Secret redaction, written once: URLs, librdkafka secrets and one-line error texts.

Passwords in URLs and SASL/TLS secrets must never reach logs, errors, metrics or health output,
also when the input is malformed (DESIGN.md I10). Every message that may quote a URL or a Kafka
setting goes through these functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit, urlunsplit

# librdkafka property names whose values are secrets.
_SECRET_WORDS = ("password", "secret", "key.pem", "token", "sasl.oauthbearer.config")


def redact_url(url: str) -> str:
    """Return ``url`` with any password replaced by ``***`` (safe for logs and errors)."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparseable URL>"
    if password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def is_secret_setting(name: str) -> bool:
    """True for a librdkafka property whose value must not be shown (passwords, keys...)."""
    lowered = name.lower()
    return any(word in lowered for word in _SECRET_WORDS)


def redact(
    text: str,
    *,
    urls: Iterable[str | None] = (),
    kafka_config: Mapping[str, object] | None = None,
) -> str:
    """Hide in ``text`` the passwords of ``urls`` and the secret values of ``kafka_config``."""
    for url in urls:
        if url:
            text = text.replace(url, redact_url(url))
    for name, value in (kafka_config or {}).items():
        if is_secret_setting(name) and isinstance(value, str) and value:
            text = text.replace(value, "***")
    return text


def one_line(
    exc: BaseException,
    *,
    urls: Iterable[str | None] = (),
    kafka_config: Mapping[str, object] | None = None,
    with_type: bool = True,
) -> str:
    """The first line of ``exc``'s message (of the driver's error under a SQLAlchemy wrapper),
    secrets redacted, prefixed with the exception type unless ``with_type`` is false."""
    origin = getattr(exc, "orig", None)
    source = origin if isinstance(origin, BaseException) else exc
    lines = str(source).strip().splitlines()
    text = redact(lines[0], urls=urls, kafka_config=kafka_config) if lines else ""
    if not with_type:
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
