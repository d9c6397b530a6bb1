"""The claim of an idempotency key, decided once for every flavour of the unit of work.

An attempt at ``(scope, key)`` first tries the key's transaction-scoped advisory lock (id from
:func:`lock_id`) and reads any committed outcome in the same round trip. What it learns -- did
it get the lock, and what outcome (if any) is stored, in PostgreSQL or in the Redis cache --
decides what happens next (:func:`verdict`):

* no stored outcome and the lock taken: run the body (:data:`RUN`);
* no stored outcome and the lock held elsewhere: :class:`~outbox.errors.KeyInProgress`, at once;
* another fingerprint stored: :class:`~outbox.errors.KeyReuseError`;
* a stored failure: :class:`~outbox.errors.PreviouslyFailed`;
* a stored completion: replay its result (:data:`REPLAY`).

How long the cache may keep an outcome warmed from PostgreSQL is decided here as well
(:func:`warm_ttl`): never longer than PostgreSQL keeps the key.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Final

from outbox.errors import KeyInProgress, KeyReuseError, PreviouslyFailed

STATUS_COMPLETED: Final = "completed"
STATUS_FAILED: Final = "failed"

RUN: Final = "run"
REPLAY: Final = "replay"

# Error texts stored with a failed key are cut to this many characters.
MAX_ERROR_TEXT: Final = 4000


def lock_id(scope: str, key: str) -> int:
    """The signed 64-bit advisory lock id of ``(scope, key)``.

    The single-``bigint`` advisory lock space is used only for keys; lock ids of other
    components use the two-``int4`` form, a separate lock space in PostgreSQL.
    """
    digest = hashlib.blake2b(f"{len(scope)}:{scope}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


@dataclass(frozen=True, slots=True)
class StoredOutcome:
    """A committed outcome of a key: ``status`` is completed or failed."""

    status: str
    fingerprint: str | None
    result_json: str | None
    error: str | None


def verdict(
    scope: str,
    key: str,
    fingerprint: str | None,
    stored: StoredOutcome | None,
    acquired: bool,
) -> str:
    """:data:`RUN` or :data:`REPLAY`; raises when the attempt must not go on (see module)."""
    if stored is None:
        if acquired:
            return RUN
        raise KeyInProgress(scope, key)
    if fingerprint is not None and stored.fingerprint not in (None, fingerprint):
        raise KeyReuseError(scope, key)
    if stored.status == STATUS_FAILED:
        raise PreviouslyFailed(scope, key, stored.error or "")
    return REPLAY


def warm_ttl(cache_ttl: float, retention: float, age: float | None) -> float | None:
    """Seconds the cache may keep an outcome read from PostgreSQL, or ``None`` for not at all.

    ``outbox gc`` deletes a key ``retention`` after its last update (``age`` seconds ago):
    Redis must not answer for a key the database has forgotten.
    """
    ttl = min(cache_ttl, retention - float(age or 0.0))
    return ttl if ttl >= 1.0 else None


def failure_text(exc: BaseException) -> str:
    """The error text stored with a key that failed permanently."""
    return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_TEXT]
