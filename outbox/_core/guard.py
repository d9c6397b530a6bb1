"""Pure decisions of the Redis guard: settings, key layout, and verdicts on the scripts' answers.

Invariant: settings and input are refused before any I/O, and any answer of the scripts this
module cannot read becomes :class:`~outbox.errors.GuardUnavailable`: garbage in Redis never
escapes as another exception.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from outbox._core import decorating
from outbox._core.decorating import check_decorated_flavour
from outbox._core.settings import check_exception_classes
from outbox.errors import (
    ConfigurationError,
    GuardUnavailable,
    KeyInProgress,
    KeyReuseError,
    PreviouslyFailed,
)

POLICIES = ("closed", "open")
DEFAULT_LEASE = 30.0
DEFAULT_COMPLETED_TTL = 24 * 3600.0
DEFAULT_FAILED_TTL = 24 * 3600.0
DEFAULT_PREFIX = "outbox-guard"
MIN_LEASE = 0.01
MAX_LEASE = 24 * 3600.0
MIN_TTL = 0.001
MAX_TTL = 366 * 24 * 3600.0
MAX_PREFIX_LENGTH = 64
MAX_ERROR_TEXT = 4000
# Lua numbers are doubles: fences stay far below 2**53, where integers are still exact.
MAX_FENCE = 10**15

_PREFIX = re.compile(r"[A-Za-z0-9._:-]+")  # fullmatch: `$` would let a final newline in
MIN_SECRET_BYTES = 16
_GUARD_PERSON = b"outbox-guard-v1"
SIGNED = "s1:"  # how a signed outcome starts: s1:<expiry ms>:<MAC>:<value>


def _seconds(name: str, value: object, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(
            f"{name} must be a number of seconds, got {type(value).__name__} {value!r}"
        )
    if not math.isfinite(value) or not low <= value <= high:
        raise ConfigurationError(
            f"{name} must be between {low:g} and {high:g} seconds, got {value!r}"
        )
    return float(value)


def check_lease(name: str, value: object) -> float:
    """A lease: a number of seconds from :data:`MIN_LEASE` to :data:`MAX_LEASE`."""
    return _seconds(name, value, MIN_LEASE, MAX_LEASE)


def check_policy(name: str, value: object) -> str:
    """``on_redis_error``: one of :data:`POLICIES`."""
    if not isinstance(value, str) or value not in POLICIES:
        raise ConfigurationError(
            f"{name} must be 'closed' (refuse to run when Redis cannot answer) or "
            f"'open' (run unguarded, the body may run twice), got {value!r}"
        )
    return value


@dataclass(frozen=True)
class GuardConfig:
    """Settings of a :class:`~outbox.guard.RedisGuard` (checked by :meth:`validate`).

    ``lease`` is how long a claim holds its key without a sign of life; ``completed_ttl`` and
    ``failed_ttl`` how long outcomes are kept. ``on_redis_error`` is ``"closed"`` (no body runs
    when the guard cannot decide) or ``"open"`` (the body runs unguarded, with a warning).
    ``renew`` renews the lease while a body runs. ``prefix`` starts every Redis key.
    ``permanent_errors`` are exception classes that, besides
    :class:`~outbox.errors.PermanentError`, record the key as FAILED (the unit of work's
    ``OutboxConfig.permanent_errors``).
    """

    lease: float = DEFAULT_LEASE
    on_redis_error: str = "closed"
    completed_ttl: float = DEFAULT_COMPLETED_TTL
    failed_ttl: float = DEFAULT_FAILED_TTL
    prefix: str = DEFAULT_PREFIX
    renew: bool = False
    permanent_errors: tuple[type[BaseException], ...] = ()
    # Signs COMPLETED and FAILED records (see sign_outcome); never shown by repr.
    secret: bytes | str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.permanent_errors, list):
            object.__setattr__(self, "permanent_errors", tuple(self.permanent_errors))
        if isinstance(self.secret, str):
            object.__setattr__(self, "secret", self.secret.encode("utf-8", "surrogatepass"))

    def validate(self) -> GuardConfig:
        """Return ``self`` when every setting is usable; raise ``ConfigurationError`` otherwise."""
        check_lease("lease", self.lease)
        _seconds("completed_ttl", self.completed_ttl, MIN_TTL, MAX_TTL)
        _seconds("failed_ttl", self.failed_ttl, MIN_TTL, MAX_TTL)
        check_policy("on_redis_error", self.on_redis_error)
        if (
            not isinstance(self.prefix, str)
            or not 0 < len(self.prefix) <= MAX_PREFIX_LENGTH
            or not _PREFIX.fullmatch(self.prefix)
        ):
            raise ConfigurationError(
                f"prefix must be 1-{MAX_PREFIX_LENGTH} letters, digits or '._:-' (no braces: "
                f"the key's hash tag follows it), got {self.prefix!r}"
            )
        if not isinstance(self.renew, bool):
            raise ConfigurationError(f"renew must be True or False, got {self.renew!r}")
        check_exception_classes("permanent_errors", self.permanent_errors)
        if self.secret is not None and (
            not isinstance(self.secret, bytes) or len(self.secret) < MIN_SECRET_BYTES
        ):
            raise ConfigurationError(
                f"secret must be at least {MIN_SECRET_BYTES} bytes (e.g. "
                "secrets.token_hex(32)), the same for every process sharing the guard's Redis"
            )
        return self

    @property
    def signing_key(self) -> bytes | None:
        """The key of the records' MACs, derived from ``secret``; ``None``: unsigned."""
        if not isinstance(self.secret, bytes):
            return None
        return hashlib.blake2b(self.secret, digest_size=32, person=_GUARD_PERSON).digest()

    @property
    def lease_ms(self) -> int:
        return max(1, round(self.lease * 1000))

    @property
    def completed_ttl_ms(self) -> int:
        return max(1, round(self.completed_ttl * 1000))

    @property
    def failed_ttl_ms(self) -> int:
        return max(1, round(self.failed_ttl * 1000))

    @property
    def keep_ms(self) -> int:
        """How long a released or abandoned record (and with it the fence) is kept."""
        return max(self.completed_ttl_ms, self.failed_ttl_ms)

    @property
    def renew_interval(self) -> float:
        """Renewal every third of the lease: two renewals may fail before the lease runs out."""
        return self.lease / 3


def record_key(prefix: str, scope: str, key: str) -> str:
    """The Redis key holding the state of ``(scope, key)``.

    The braces are a Cluster hash tag: every key of one claim maps to one slot, while different
    keys spread over the masters. The scope's length makes ``("a:b", "c")`` and ``("a", "b:c")``
    two records. A ``}`` in the key ends the tag early, which still maps a given
    ``(scope, key)`` to one slot every time.
    """
    return f"{prefix}:{{{len(scope)}:{scope}:{key}}}"


def new_token() -> str:
    """A token naming one owner of one claim; every transition checks it."""
    return secrets.token_hex(16)


def error_text(exc: BaseException) -> str:
    """The text stored for a permanent failure (replayed by ``PreviouslyFailed``)."""
    return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_TEXT]


def _outcome_mac(
    key: bytes, redis_key: str, status: str, fingerprint: str, expires_ms: int, value: str
) -> str:
    digest = hashlib.blake2b(key=key, digest_size=16)
    for part in (redis_key, status, fingerprint, str(expires_ms), value):
        data = part.encode("utf-8", "surrogatepass")
        digest.update(b"%d:" % len(data))
        digest.update(data)
    return digest.hexdigest()


def sign_outcome(
    key: bytes, redis_key: str, status: str, fingerprint: str, value: str, expires_ms: int
) -> str:
    """The stored form of a COMPLETED (``status`` ``"C"``, ``value`` the result JSON) or FAILED
    (``"F"``, the error text) outcome of a guard with a secret: the value with a MAC over the
    Redis key, the status, the claim's fingerprint (``""`` for none), the expiry (ms since the
    epoch) and the value. A Redis writer without the secret cannot make one, move one to
    another key or status, or keep one past its expiry."""
    mac = _outcome_mac(key, redis_key, status, fingerprint, expires_ms, value)
    return f"{SIGNED}{expires_ms}:{mac}:{value}"


def verify_outcome(
    key: bytes, redis_key: str, status: str, fingerprint: str, stored: str, now_ms: int
) -> str:
    """The value of an outcome stored by :func:`sign_outcome`; anything else -- unsigned,
    forged, moved, expired -- is unreadable (``GuardUnavailable``), never replayed."""
    if not stored.startswith(SIGNED):
        raise _Unreadable("holds an outcome that is not signed (with the guard's secret)")
    expires, _, rest = stored[len(SIGNED) :].partition(":")
    mac, _, value = rest.partition(":")
    if not expires.isdigit() or len(expires) > 20:
        raise _Unreadable("holds a signed outcome without a valid expiry")
    expected = _outcome_mac(key, redis_key, status, fingerprint, int(expires), value)
    if not hmac.compare_digest(mac.encode("ascii", "replace"), expected.encode("ascii")):
        raise _Unreadable("holds an outcome whose signature does not match (forged or moved)")
    if int(expires) <= now_ms:
        raise _Unreadable("holds a signed outcome kept past its expiry")
    return value


# ------------------------------------------------------------------------------- verdicts


@dataclass(frozen=True)
class Owned:
    """This owner holds the key: run the body. ``takeover``: a previous owner's lease ran out."""

    fence: int
    takeover: bool


@dataclass(frozen=True)
class Replay:
    """The key completed earlier: ``result`` is its stored result (decoded from JSON)."""

    result: Any


@dataclass(frozen=True)
class Transition:
    """The answer to complete, fail, release or renew: ``ok``, or lost to ``fence``'s owner."""

    ok: bool
    fence: int


class _Unreadable(Exception):
    """A reply or record the guard cannot read (turned into GuardUnavailable)."""


def _text(value: object) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _Unreadable("holds bytes that are not UTF-8") from exc
    if isinstance(value, str):
        return value
    raise _Unreadable(f"answered {type(value).__name__} where text was expected")


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Unreadable(f"answered {type(value).__name__} where an integer was expected")
    return value


def _parts(reply: object, sizes: dict[str, int]) -> tuple[str, list[object]]:
    if not isinstance(reply, list | tuple) or not reply:
        raise _Unreadable(f"answered {type(reply).__name__} where a list was expected")
    kind = _text(reply[0])
    if kind == "corrupt":
        raise _Unreadable(_text(reply[1]) if len(reply) == 2 else "is unreadable")
    if sizes.get(kind) != len(reply):
        raise _Unreadable(f"answered {kind!r} with {len(reply)} elements")
    return kind, list(reply[1:])


def unreadable(scope: str, key: str, redis_key: str, why: str) -> GuardUnavailable:
    """The error for a record (or script answer) the guard cannot read."""
    return GuardUnavailable(
        f"the guard's record of idempotency key {key!r} in scope {scope!r} (Redis key "
        f"{redis_key!r}) {why}: it was not written by this guard. Inspect it, and delete it "
        "(DEL) to let the key run again",
        scope=scope,
        key=key,
    )


def redis_failed(scope: str, key: str, exc: BaseException) -> GuardUnavailable:
    """The error for a Redis call that failed (down, slow, refusing, out of memory...)."""
    return GuardUnavailable(
        f"Redis failed the guard for idempotency key {key!r} in scope {scope!r} "
        f"({type(exc).__name__}: {exc}); check that Redis is up, reachable and accepting writes",
        scope=scope,
        key=key,
    )


def not_run(cause: GuardUnavailable) -> GuardUnavailable:
    """The error when the guard could not decide, under ``on_redis_error="closed"``."""
    return GuardUnavailable(
        f"{cause}. The body was not run (on_redis_error='closed'; 'open' runs bodies unguarded "
        "while the guard cannot decide, at the risk of running them twice)",
        scope=cause.scope,
        key=cause.key,
    )


def not_recorded(scope: str, key: str, lease: float, cause: GuardUnavailable) -> GuardUnavailable:
    """The error for a body that ran but whose outcome Redis did not record."""
    return GuardUnavailable(
        f"the body of idempotency key {key!r} in scope {scope!r} ran, but its outcome was not "
        f"recorded: {cause}. The key stays busy until its lease runs out ({lease:g}s); a "
        "retry after that runs the body again",
        scope=scope,
        key=key,
    )


def load_result(raw: object) -> Any:
    """Decode a stored result; anything but JSON text is unreadable."""
    text = _text(raw)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # truncated, not JSON, or nested too deep
        raise _Unreadable(f"holds a result that is not JSON ({type(exc).__name__})") from exc


def decode_claim(
    reply: object,
    scope: str,
    key: str,
    fingerprint: str | None,
    redis_key: str,
    signing_key: bytes | None = None,
    now_ms: int = 0,
) -> Owned | Replay:
    """The verdict of the claim script for ``(scope, key)``.

    Returns :class:`Owned` or :class:`Replay`; raises ``KeyInProgress`` (a live owner),
    ``PreviouslyFailed``, ``KeyReuseError`` (another fingerprint) or ``GuardUnavailable`` (an
    answer or record the guard cannot read). With a ``signing_key``, a stored outcome is
    trusted only when :func:`verify_outcome` accepts it at ``now_ms``.
    """
    try:
        kind, rest = _parts(reply, {"new": 3, "busy": 2, "done": 3, "failed": 3})
        if kind == "new":
            fence = _int(rest[0])
            if not 0 < fence <= MAX_FENCE:
                raise _Unreadable(f"answered fence {fence}")
            return Owned(fence, bool(_int(rest[1])))
        if kind == "busy":
            raise KeyInProgress(scope, key)
        stored = _text(rest[1])
        value = _text(rest[0])
        if signing_key is not None:
            status = "C" if kind == "done" else "F"
            value = verify_outcome(signing_key, redis_key, status, stored, value, now_ms)
        if fingerprint is not None and stored not in ("", fingerprint):
            raise KeyReuseError(scope, key)
        if kind == "failed":
            raise PreviouslyFailed(scope, key, value)
        return Replay(load_result(value))
    except _Unreadable as exc:
        raise unreadable(scope, key, redis_key, str(exc)) from None


def decode_transition(reply: object, scope: str, key: str, redis_key: str) -> Transition:
    """The answer of the finish or renew script: done, or the key belongs to someone else."""
    try:
        kind, rest = _parts(reply, {"ok": 2, "lost": 2})
        fence = _int(rest[0])
    except _Unreadable as exc:
        raise unreadable(scope, key, redis_key, str(exc)) from None
    return Transition(kind == "ok", fence)


# ------------------------------------------------------------------------------- decorator


def guard_arguments_key(
    func: Callable[..., Any], key: str | Callable[..., str], is_async: bool
) -> Callable[..., str]:
    """How ``@guard.idempotent`` finds the key among the caller's arguments (the function
    takes the claim first, the caller's arguments after it)."""
    check_decorated_flavour(func, is_async, "RedisGuard", "AsyncRedisGuard")
    return decorating.arguments_key(func, key, "claim")
