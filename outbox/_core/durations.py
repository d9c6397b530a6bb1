"""Durations as operators type them (``7d``, ``36h``, ``1d12h``, seconds), and the retention rule.

Invariant: a retention never lets a duplicate run twice (:func:`check_retention`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from outbox._core.environment import ENV_CACHE_TTL, ENV_MIN_REDELIVERY_WINDOW
from outbox._core.settings import MAX_SECONDS
from outbox._core.validate import shown
from outbox.errors import ConfigurationError, RetentionError

_UNITS = {"w": 7 * 86400.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_DURATION = re.compile(r"(?:\d+(?:\.\d+)?[wdhms])+")  # used with fullmatch
_PART = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``7d``, ``36h``, ``90m``, ``1d12h`` or ``1.5h``.

    Units: ``w`` weeks, ``d`` days, ``h`` hours, ``m`` minutes, ``s`` seconds; parts add up.
    A bare number is seconds (what ``OutboxConfig.cache_ttl`` holds). The result must be
    positive. Raises :class:`ConfigurationError` with the accepted forms otherwise.
    """
    cleaned = text.strip().lower().replace(" ", "") if isinstance(text, str) else ""
    if _NUMBER.fullmatch(cleaned):
        seconds = float(cleaned)
    elif _DURATION.fullmatch(cleaned):
        seconds = sum(float(n) * _UNITS[u] for n, u in _PART.findall(cleaned))
    else:
        raise ConfigurationError(
            f"invalid duration {shown(text)}: use a number with a unit, e.g. 7d, 36h, 90m, 45s or "
            "1d12h (w=weeks, d=days, h=hours, m=minutes, s=seconds)"
        )
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigurationError(f"invalid duration {shown(text)}: it must be longer than zero")
    if seconds > MAX_SECONDS:
        raise ConfigurationError(
            f"invalid duration {shown(text)}: it must not exceed {format_duration(MAX_SECONDS)}"
        )
    return seconds


def format_duration(seconds: float) -> str:
    """A compact, readable duration: ``7d``, ``1d12h``, ``90m`` -> ``1h30m``, ``2.5s``.

    Whole seconds are split into d/h/m/s parts; a fraction is kept on the seconds.
    """
    if seconds < 0:
        return "-" + format_duration(-seconds)
    whole = int(seconds)
    fraction = seconds - whole
    if whole < 60:
        value = seconds if fraction else whole
        return f"{value:.3g}s" if fraction else f"{value}s"
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, whole = divmod(whole, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


# How late a broker may redeliver a message: no key may be forgotten sooner. One default for
# ``outbox gc`` and ``OutboxConfig``.
DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS = 7 * 24 * 3600.0


def check_retention(
    older_than: float, cache_ttl: float, min_redelivery_window: float, *, config: bool = False
) -> None:
    """Refuse a retention under which a duplicate could run its effects twice: the one rule of
    ``outbox gc --older-than`` and of ``OutboxConfig.retention`` (``config=True`` words the
    refusal in the configuration's field names).

    * It must be **longer than the Redis cache TTL**: otherwise the cache would still answer
      for keys PostgreSQL has forgotten, and whether a duplicate replays or runs again would
      depend on which copy it meets (and, after the cache entry expires, it runs again).
      ``OutboxConfig.validate()`` holds ``retention`` to the same rule.
    * It must be **at least the minimum redelivery window**: a broker can redeliver a message
      that long after it was first handled (a consumer restarting from old offsets, a replay);
      if its key is already gone, the duplicate runs twice.
    """
    if config:
        if older_than <= cache_ttl:
            raise RetentionError(
                f"cache_ttl ({format_duration(cache_ttl)}) must be shorter than retention "
                f"({format_duration(older_than)}): otherwise Redis could replay a key the "
                "database has already forgotten"
            )
        if older_than < min_redelivery_window:
            raise RetentionError(
                f"retention ({format_duration(older_than)}) must be at least "
                f"min_redelivery_window ({format_duration(min_redelivery_window)}), the rule "
                "outbox gc holds --older-than to: a message redelivered after its key was "
                "deleted would run twice. Lower min_redelivery_window only if no broker can "
                "redeliver that late"
            )
        return
    if older_than <= cache_ttl:
        raise RetentionError(
            f"refusing --older-than {format_duration(older_than)}: it must be longer than the "
            f"Redis cache TTL ({format_duration(cache_ttl)}, --cache-ttl / {ENV_CACHE_TTL}). "
            "Redis would still answer for keys PostgreSQL had forgotten, so a duplicate could "
            "run twice once the cache entry expires. Use a longer --older-than, or lower "
            "--cache-ttl if the application's OutboxConfig.cache_ttl really is shorter."
        )
    if older_than < min_redelivery_window:
        raise RetentionError(
            f"refusing --older-than {format_duration(older_than)}: it is shorter than the "
            f"minimum redelivery window ({format_duration(min_redelivery_window)}, "
            f"--min-redelivery-window / {ENV_MIN_REDELIVERY_WINDOW}). A message redelivered "
            "after its key was deleted would run twice. Use a longer --older-than, or lower "
            "--min-redelivery-window if no broker can redeliver that late (e.g. a shorter "
            "topic retention)."
        )


def format_ranges(values: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 7, 9, 10]`` -> ``0-3,7,9-10`` (``-`` when empty)."""
    items = sorted(set(values))
    if not items:
        return "-"
    parts: list[str] = []
    start = prev = items[0]
    for v in items[1:]:
        if v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = v
    parts.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(parts)
