"""The cache's entry format: signed JSON, read defensively; pure, shared by both flavours.

An entry is one JSON object::

    {"s":"completed","f":<fingerprint>,"r":<result JSON text>,"x":<expiry, ms>,"m":"<MAC>"}
    {"s":"failed","f":<fingerprint>,"e":<error text>,"x":<expiry, ms>,"m":"<MAC>"}

``m`` is always last: a keyed BLAKE2b MAC (128 bits, hex) over the Redis key and every
byte before ``,"m":"``. Its key (:func:`derive_key`) comes from a secret kept in PostgreSQL
and the database's identity (its cluster's system identifier and timeline included), so only a
process that can read the database can write an entry the cache trusts, and an entry is bound
to its Redis key (it cannot be copied to another key) and
to its expiry (it cannot be made to outlive the key's retention).

Reading is bounded: anything that is not a byte string of at most :data:`MAX_ENTRY_BYTES`
with a valid MAC is a miss before any JSON is parsed; what is parsed was written by this
module. Nothing here raises on what Redis hands back.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from outbox._core.claim import STATUS_COMPLETED, STATUS_FAILED, StoredOutcome

# Larger outcomes are not cached: PostgreSQL answers their duplicates.
MAX_ENTRY_BYTES = 1024 * 1024
_MAC_BYTES = 16
_MAC_CHARS = 2 * _MAC_BYTES  # hex
_MAC_FIELD = b',"m":"'
_TAIL = len(_MAC_FIELD) + _MAC_CHARS + 2  # ,"m":"<32 hex digits>"}
_PERSON = b"outbox-cache-v1"
# One encoder for every entry (json.dumps with options builds a new one at each call); the same
# bytes as json.dumps(entry, ensure_ascii=False, separators=(",", ":")).
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_DECODER = json.JSONDecoder()
# How _ENCODER writes a string (ensure_ascii=False): the C function, where there is one.
_quote = json.encoder.encode_basestring


def _json_text(value: str | None) -> str:
    return "null" if value is None else _quote(value)


def derive_key(
    secret: bytes,
    database_oid: int,
    keys_oid: int | None,
    system_identifier: int,
    timeline: int,
) -> bytes:
    """The MAC key of one database's cache entries (see :mod:`outbox._pg.identity`): the
    secret, the cluster's system identifier and timeline, and the OIDs of the database and of
    its ``idempotency_keys`` table."""
    identity = f"{system_identifier}:{timeline}:{database_oid}:{keys_oid}".encode()
    return hashlib.blake2b(
        identity, key=bytes(secret)[:64], digest_size=32, person=_PERSON
    ).digest()


class Signer:
    """MACs with one key; the keyed state is set up once and copied per entry."""

    __slots__ = ("_keyed",)

    def __init__(self, key: bytes) -> None:
        self._keyed = hashlib.blake2b(key=key, digest_size=_MAC_BYTES)

    def mac(self, redis_key: bytes, signed: bytes) -> bytes:
        digest = self._keyed.copy()
        digest.update(redis_key)
        digest.update(b"\x00")
        digest.update(signed)
        return digest.hexdigest().encode("ascii")


def _signer(key: bytes | Signer) -> Signer:
    return key if isinstance(key, Signer) else Signer(key)


def encode_entry(
    outcome: StoredOutcome, key: bytes | Signer, redis_key: str, expires_ms: int
) -> bytes | None:
    """The signed entry of ``outcome`` under ``redis_key``, trusted until ``expires_ms``
    (milliseconds since the epoch); ``None`` when it would exceed :data:`MAX_ENTRY_BYTES`."""
    status, fingerprint = outcome.status, outcome.fingerprint
    if status == STATUS_COMPLETED:
        field, value = "r", outcome.result_json
    else:
        field, value = "e", outcome.error
    if (
        type(status) is str
        and (fingerprint is None or type(fingerprint) is str)
        and (value is None or type(value) is str)
    ):
        # What _ENCODER makes of the entry's dict, without building an encoder for each entry.
        signed = (
            f'{{"s":{_quote(status)},"f":{_json_text(fingerprint)},'
            f'"{field}":{_json_text(value)},"x":{int(expires_ms)}'
        ).encode()
    else:
        entry: dict[str, Any] = {"s": status, "f": fingerprint, field: value}
        entry["x"] = int(expires_ms)
        signed = _ENCODER.encode(entry).encode("utf-8")[:-1]  # without the closing brace
    if len(signed) + _TAIL > MAX_ENTRY_BYTES:
        return None
    mac = _signer(key).mac(redis_key.encode("utf-8"), signed)
    return signed + _MAC_FIELD + mac + b'"}'


def decode_entry(
    raw: object, key: bytes | Signer, redis_key: str, now_ms: int
) -> StoredOutcome | None:
    """The outcome in a cache entry; ``None`` for anything that is not an unexpired entry
    signed with ``key`` for ``redis_key``."""
    # Garbage, forgeries and entries of another database must never change an outcome.
    if isinstance(raw, str):
        try:
            raw = raw.encode("utf-8")
        except UnicodeEncodeError:
            return None
    if not isinstance(raw, bytes) or not _TAIL < len(raw) <= MAX_ENTRY_BYTES:
        return None
    signed, tail = raw[:-_TAIL], raw[-_TAIL:]
    if not (tail.startswith(_MAC_FIELD) and tail.endswith(b'"}')):
        return None
    given = tail[len(_MAC_FIELD) : -2]
    if not hmac.compare_digest(given, _signer(key).mac(redis_key.encode("utf-8"), signed)):
        return None
    try:
        entry = _DECODER.decode(raw.decode("utf-8"))  # json.loads, minus its sniffing of bytes
    except (ValueError, RecursionError):  # pragma: no cover - signed entries are ours
        return None
    return _outcome(entry, now_ms)


def _outcome(entry: Any, now_ms: int) -> StoredOutcome | None:
    if not isinstance(entry, dict):
        return None
    expires = entry.get("x")
    if not isinstance(expires, int) or isinstance(expires, bool) or expires <= now_ms:
        return None
    fingerprint = entry.get("f")
    if fingerprint is not None and not isinstance(fingerprint, str):
        return None
    status = entry.get("s")
    if status == STATUS_COMPLETED:
        result_json = entry.get("r")
        if result_json is not None and not isinstance(result_json, str):
            return None
        return StoredOutcome(STATUS_COMPLETED, fingerprint, result_json, None)
    if status == STATUS_FAILED:
        error = entry.get("e")
        if not isinstance(error, str):
            return None
        return StoredOutcome(STATUS_FAILED, fingerprint, None, error)
    return None
