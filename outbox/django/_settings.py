"""``settings.OUTBOX`` and the database alias: what the Django door reads from the project.

``OUTBOX = {"DATABASE": "default", "REDIS_URL": "redis://...", "SCHEMA": None,
"CACHE_PREFIX": "outbox", "HTTP": {...}, "KAFKA": {...}}``; every key is optional (``HTTP``: the
Idempotency-Key middleware's options, see :mod:`outbox.django.middleware`; ``KAFKA``: the
management commands' broker, ``{"bootstrap.servers": ...}``). The toolkit's tables live in the
database of that ``DATABASES`` alias, which must use Django's PostgreSQL backend on psycopg 3.
"""

from __future__ import annotations

import threading
from typing import Any

import sqlalchemy as sa
from django.conf import settings
from django.db import connections
from django.db.backends.postgresql.psycopg_any import is_psycopg3

from outbox import migrate
from outbox.config import OutboxConfig
from outbox.errors import ConfigurationError
from outbox.uow import Outbox

KEYS = ("DATABASE", "REDIS_URL", "SCHEMA", "CACHE_PREFIX", "HTTP", "KAFKA")

_lock = threading.Lock()
_outboxes: dict[tuple[str, str], Outbox] = {}


def outbox_settings() -> dict[str, Any]:
    """``settings.OUTBOX``, checked: a dict of the known keys."""
    value = getattr(settings, "OUTBOX", {})
    if not isinstance(value, dict):
        raise ConfigurationError(f"settings.OUTBOX must be a dict, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in KEYS)
    if unknown:
        raise ConfigurationError(
            f"settings.OUTBOX has unknown keys {unknown}; the keys are {list(KEYS)}"
        )
    return value


def alias_of(using: str | None) -> str:
    """The ``DATABASES`` alias: ``using``, else ``OUTBOX["DATABASE"]``, else ``"default"``."""
    alias = using if using is not None else outbox_settings().get("DATABASE", "default")
    if not isinstance(alias, str) or alias not in settings.DATABASES:
        raise ConfigurationError(
            f"database alias {alias!r} is not in settings.DATABASES ({sorted(settings.DATABASES)})"
        )
    return alias


def database_url(alias: str) -> sa.URL:
    """A ``postgresql+psycopg://`` URL of the database Django's ``alias`` connects to now (a
    test run's test database included)."""
    connection = connections[alias]
    if connection.vendor != "postgresql":
        raise ConfigurationError(
            f"DATABASES[{alias!r}] uses the {connection.vendor} backend: the outbox needs "
            "django.db.backends.postgresql"
        )
    if not is_psycopg3:
        raise ConfigurationError(
            "Django's PostgreSQL backend runs on psycopg2 here: the outbox needs psycopg 3 "
            "(pip install 'psycopg[binary]>=3.2'; Django uses it when it is installed)"
        )
    s = connection.settings_dict
    return sa.URL.create(
        "postgresql+psycopg",
        username=s.get("USER") or None,
        password=s.get("PASSWORD") or None,
        host=s.get("HOST") or None,
        port=int(s["PORT"]) if s.get("PORT") else None,
        database=s.get("NAME") or None,
    )


def outbox_for(alias: str) -> Outbox:
    """The :class:`~outbox.Outbox` beside Django's connection ``alias``: its cache, its reads
    after a commit and its relay wake-ups run on a pool of its own; the units of work
    themselves run on Django's connection."""
    url = database_url(alias)
    rendered = url.render_as_string(hide_password=False)
    with _lock:
        ob = _outboxes.get((alias, rendered))
        if ob is None:
            options = outbox_settings()
            config = OutboxConfig(
                schema=options.get("SCHEMA"),
                cache_prefix=options.get("CACHE_PREFIX", "outbox"),
            )
            engine = sa.create_engine(url, pool_size=2, max_overflow=8)
            ob = Outbox(engine, redis_url=options.get("REDIS_URL"), config=config)
            _outboxes[(alias, rendered)] = ob
        return ob


def reset() -> None:
    """Forget the outboxes made so far (tests that change the settings or the database)."""
    with _lock:
        for ob in _outboxes.values():
            ob.close()
            ob.engine.dispose()
        _outboxes.clear()


def migrate_to_head(alias: str) -> None:
    """Run the toolkit's alembic history to its head on the database of ``alias``."""
    engine = sa.create_engine(database_url(alias), poolclass=sa.pool.NullPool)
    try:
        migrate.upgrade(engine, schema=outbox_settings().get("SCHEMA"))
    finally:
        engine.dispose()
