"""Pure checks of settings: numbers, names and librdkafka properties, refused before any I/O.

Every configuration dataclass, command-line flag and ``OUTBOX_*`` variable goes through these,
so a setting that is NaN, infinite, negative, absurdly large, of the wrong type or not valid
text raises :class:`~outbox.errors.ConfigurationError` naming the setting -- never a
``TypeError`` or ``OverflowError`` from deep inside a driver, and never after a connection was
opened. Messages quote a refused value only when it cannot be a secret.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Mapping
from typing import Any

from outbox._core.redact import is_secret_setting
from outbox._core.validate import is_utf8, shown
from outbox.errors import ConfigurationError

# Upper bounds that no sane setting reaches; beyond them timers and TTLs overflow.
MAX_SECONDS = 100 * 365 * 86400.0  # durations: a century
MAX_TIMEOUT = 3600.0  # socket and connect timeouts, pauses between retries
MAX_PORT = 65535
MAX_KAFKA_VALUE_LENGTH = 65536
MAX_KAFKA_SETTINGS = 1000
MAX_BOOTSTRAP_LENGTH = 4096

_KAFKA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_HOST = re.compile(r"[A-Za-z0-9.:-]{1,253}")
_CACHE_PREFIX = re.compile(r"[A-Za-z0-9._:-]{1,100}")
_BOOTSTRAP_ITEM = re.compile(
    r"(?:[A-Za-z_]+://)?(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::\d{1,5})?"
)


def check_int(name: str, value: object, low: int, high: int) -> int:
    """An ``int`` (not a ``bool``) from ``low`` to ``high``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(
            f"{name} must be an integer from {low} to {high}, got {shown(value)}"
        )
    if not low <= value <= high:
        raise ConfigurationError(f"{name} must be from {low} to {high}, got {value}")
    return value


def check_seconds(
    name: str, value: object, high: float = MAX_SECONDS, *, zero: bool = False
) -> float:
    """A finite number of seconds, positive (or zero when ``zero``), at most ``high``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(f"{name} must be a number of seconds, got {shown(value)}")
    number = float(value) if isinstance(value, float) else value
    if isinstance(number, float) and not math.isfinite(number):
        raise ConfigurationError(f"{name} must be a finite number of seconds, got {value!r}")
    if number < 0 or (number == 0 and not zero):
        raise ConfigurationError(f"{name} must be positive, got {value!r}")
    if number > high:
        raise ConfigurationError(f"{name} must be at most {high:g} seconds, got {value!r}")
    return float(number)


def check_port(name: str, value: object, *, optional: bool = True) -> int | None:
    """A TCP port (0: any free port), or ``None`` when ``optional``."""
    if value is None and optional:
        return None
    return check_int(name, value, 0, MAX_PORT)


def check_host(name: str, value: object) -> str:
    """A host to listen on: an IPv4 or IPv6 address, or a host name."""
    if isinstance(value, str) and _HOST.fullmatch(value):
        if ":" not in value:
            return value
        try:
            ipaddress.IPv6Address(value)
        except ValueError:
            pass
        else:
            return value
    raise ConfigurationError(
        f"{name} must be an IP address or a host name (127.0.0.1, 0.0.0.0, ::), got {shown(value)}"
    )


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be True or False, got {shown(value)}")
    return value


def check_exception_classes(name: str, value: object) -> tuple[type[BaseException], ...]:
    """A tuple of exception classes (``permanent_errors``)."""
    if not isinstance(value, tuple):
        raise ConfigurationError(
            f"{name} must be a tuple of exception classes, got {type(value).__name__}"
        )
    for exc_type in value:
        if not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
            raise ConfigurationError(f"{name} must hold exception classes, got {shown(exc_type)}")
    return value


def check_cache_prefix(prefix: object) -> str:
    """The prefix of the cache's Redis keys: 1-100 of ``[A-Za-z0-9._:-]`` (no braces, so a
    prefix never becomes a Redis Cluster hash tag)."""
    if not isinstance(prefix, str) or not _CACHE_PREFIX.fullmatch(prefix):
        raise ConfigurationError(
            f"cache_prefix must be 1-100 letters, digits or '._:-' (non-empty and free of "
            f"braces), got {shown(prefix)}"
        )
    return prefix


def check_text_setting(name: str, value: object, *, secret: bool = False, limit: int = 4096) -> str:
    """A non-empty ``str`` of valid UTF-8 text without control characters."""
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{name} must be a non-empty str, got {type(value).__name__}")
    quoted = "" if secret else f" {shown(value)}"
    if len(value) > limit:
        raise ConfigurationError(f"{name} is longer than {limit} characters")
    if re.search(r"[\x00-\x1f\x7f]", value):
        raise ConfigurationError(f"{name}{quoted} contains a control character")
    if not is_utf8(value):
        raise ConfigurationError(f"{name}{quoted} is not valid UTF-8 text")
    return value


def check_bootstrap_servers(value: object, option: str = "bootstrap servers") -> str:
    """Kafka bootstrap servers: ``host:port[,host:port...]``."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigurationError(f"{option} must be host:port[,host:port...]")
    if len(value) > MAX_BOOTSTRAP_LENGTH or not all(
        _BOOTSTRAP_ITEM.fullmatch(item.strip()) for item in value.split(",")
    ):
        raise ConfigurationError(
            f"{option} {shown(value)} is not a list of host:port, e.g. kafka-1:9092,kafka-2:9092"
        )
    return value


def check_kafka_config(config: object, option: str = "kafka_config") -> dict[str, Any]:
    """librdkafka properties: names of ``[A-Za-z0-9._-]``; values ``str`` (valid UTF-8 text,
    no control characters), finite numbers, booleans, or callables (the client's callbacks).

    Whether librdkafka knows a property is left to the client; what it could not even
    receive is refused here. Values of secret properties are never quoted.
    """
    if not isinstance(config, Mapping):
        raise ConfigurationError(f"{option} must be a mapping of property names to values")
    if len(config) > MAX_KAFKA_SETTINGS:
        raise ConfigurationError(f"{option} has more than {MAX_KAFKA_SETTINGS} properties")
    checked: dict[str, Any] = {}
    for name, value in config.items():
        if not isinstance(name, str) or not _KAFKA_NAME.fullmatch(name):
            # Not quoted: a malformed entry may be a secret typed without its "=".
            raise ConfigurationError(
                f"{option}: a property name (not shown) is not a librdkafka property name: "
                "use letters, digits, '.', '_' and '-', as in sasl.username"
            )
        what = f"{option} {name}"
        if isinstance(value, str):
            if value:  # an empty value is librdkafka's to judge
                check_text_setting(
                    what, value, secret=is_secret_setting(name), limit=MAX_KAFKA_VALUE_LENGTH
                )
        elif isinstance(value, bool):
            pass
        elif isinstance(value, int | float):
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigurationError(f"{what} must be a finite number")
            if abs(value) > 2**63:
                raise ConfigurationError(f"{what} is out of range")
        elif not callable(value):
            raise ConfigurationError(
                f"{what} must be a str, a number, a bool or a callback, got {type(value).__name__}"
            )
        checked[name] = value
    return checked


def check_handler_reference(ref: object) -> tuple[str, list[str]]:
    """``module:attribute`` (the attribute may be dotted): Python identifiers only."""
    if not isinstance(ref, str):
        raise ConfigurationError(f"invalid handler: expected module:function, got {shown(ref)}")
    module, sep, attr = ref.partition(":")
    parts = attr.split(".")
    if (
        not sep
        or not is_utf8(ref)
        or not all(p.isidentifier() for p in module.split("."))
        or not all(p.isidentifier() for p in parts)
    ):
        raise ConfigurationError(
            f"invalid handler {shown(ref)}: expected module:function, e.g. myapp.consumers:handle"
        )
    return module, parts
