"""The relay fleet's decisions: which databases there are, who is alive, who serves which.

Several ``outbox-relay`` processes serving many databases divide them without a coordinator of
their own. Each process is a *member* with a stable id (``--member-id``, the host name by
default); while it runs, it holds the advisory lock ``(member namespace, member_key(id))`` on a
session in the fleet's membership database, so that every member reads the live members from
``pg_locks``. Each database goes to the member that ranks highest for it by rendezvous
(highest-random-weight) hashing: a member that leaves moves only its own databases, each to the
member that ranks next, and gets back the same ones when it returns (a rolling restart moves a
database at most twice). The serving member holds ``(owner namespace, 0)`` in that database on
its relay's session, so at most one process serves a database at a time even while two members
disagree for a moment about who is alive; the lanes (:mod:`outbox._core.lanes`) keep per-key
order even then.

Pure functions, tested without a database; :mod:`outbox._pg.fleet` takes and reads the locks
and :mod:`outbox.relay._fleet` runs the relays.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from outbox._core.lanes import namespace

KIND_FLEET_MEMBER = "fleet-member"
KIND_FLEET_OWNER = "fleet-owner"
MAX_MEMBER_ID = 200


def member_namespace(schema: str | None) -> int:
    """First advisory-lock key of the fleet's membership locks."""
    return namespace(schema, KIND_FLEET_MEMBER)


def owner_namespace(schema: str | None) -> int:
    """First advisory-lock key of the lock that says which process serves a database."""
    return namespace(schema, KIND_FLEET_OWNER)


def member_key(member_id: str) -> int:
    """Second advisory-lock key of a member: 31 bits of a hash of its id (reads the same in
    ``pg_locks.objid`` as in Python). Two ids that collide count as one member; the owner lock
    still keeps each database to one process."""
    digest = hashlib.blake2b(member_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def _weight(member: int, database: str) -> int:
    digest = hashlib.blake2b(f"{member}:{database}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def owner_of(database: str, members: Iterable[int]) -> int | None:
    """The member (by :func:`member_key`) that serves ``database``: the highest rendezvous
    weight, ties broken by the key. ``None`` when no member is alive."""
    best: tuple[int, int] | None = None
    for member in members:
        candidate = (_weight(member, database), member)
        if best is None or candidate > best:
            best = candidate
    return None if best is None else best[1]


def assignment(databases: Iterable[str], members: Iterable[int]) -> dict[str, int | None]:
    """Every database's serving member (:func:`owner_of`)."""
    alive = sorted(set(members))
    return {name: owner_of(name, alive) for name in databases}


def parse_databases_file(text: str) -> list[str]:
    """The URLs of a databases file: one per line; blank lines and lines starting with ``#``
    are left out, surrounding spaces stripped, repeats kept once (first place wins)."""
    seen: dict[str, None] = {}
    for line in text.splitlines():
        entry = line.strip()
        if entry and not entry.startswith("#"):
            seen.setdefault(entry, None)
    return list(seen)


def check_member_id(member_id: str) -> str:
    """A member id: 1 to 200 printable characters (it appears in logs and in ``outbox
    status``); raises ``ValueError`` otherwise."""
    if not member_id or len(member_id) > MAX_MEMBER_ID or not member_id.isprintable():
        raise ValueError(
            f"a member id is 1 to {MAX_MEMBER_ID} printable characters (got {len(member_id)})"
        )
    return member_id
