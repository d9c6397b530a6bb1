"""The cache's entry format: one JSON object per key, read defensively.

``{"s": status, "f": fingerprint, "r": result JSON text}`` for a completed key and
``{"s": "failed", "f": fingerprint, "e": error}`` for a failed one. Shared by every flavour of
the cache; pure.
"""

from __future__ import annotations

import json
from typing import Any

from outbox._core.claim import STATUS_COMPLETED, STATUS_FAILED, StoredOutcome


def encode_entry(outcome: StoredOutcome) -> str:
    """The cache entry of ``outcome``."""
    entry: dict[str, Any] = {"s": outcome.status, "f": outcome.fingerprint}
    if outcome.status == STATUS_COMPLETED:
        entry["r"] = outcome.result_json
    else:
        entry["e"] = outcome.error
    return json.dumps(entry)


def decode_entry(raw: Any) -> StoredOutcome | None:
    """The outcome in a cache entry; ``None`` for anything malformed."""
    # Garbage in Redis must never change an outcome: anything unexpected is a miss.
    try:
        entry = json.loads(raw)
        status = entry["s"]
        fingerprint = entry.get("f")
        if fingerprint is not None and not isinstance(fingerprint, str):
            return None
        if status == STATUS_COMPLETED:
            result_json = entry.get("r")
            if result_json is not None:
                if not isinstance(result_json, str):
                    return None
                json.loads(result_json)
            return StoredOutcome(STATUS_COMPLETED, fingerprint, result_json, None)
        if status == STATUS_FAILED:
            error = entry.get("e")
            if not isinstance(error, str):
                return None
            return StoredOutcome(STATUS_FAILED, fingerprint, None, error)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return None
