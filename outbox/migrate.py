"""Apply or revert outbox-kit's migrations from the installed package, beside an app's own history.

Invariant: the toolkit's migrations keep their own version table (``outbox_alembic_version``)
and ship inside the wheel, so ``outbox migrate`` needs no ``alembic.ini``; an application's
``env.py`` passes :func:`include_name` (or :func:`include_object`) to ``context.configure`` so
that its ``alembic revision --autogenerate`` leaves the toolkit's tables alone.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

from outbox._core.retry import Backoff
from outbox._core.validate import shown
from outbox._pg import migrations as pg_migrations
from outbox.config import normalize_database_url
from outbox.errors import ConfigurationError, MigrationLockError
from outbox.schema import VERSION_TABLE, tables, validate_schema_name

log = logging.getLogger("outbox.migrate")

# How long one statement of a migration waits for a lock, and how often a revision is tried.
# A strong lock asked while a long transaction holds the table queues every writer behind it:
# the timeout bounds that stall, and writers run between attempts.
DEFAULT_LOCK_TIMEOUT = 2.0
DEFAULT_LOCK_ATTEMPTS = 10
MAX_LOCK_TIMEOUT = 600.0
MAX_LOCK_ATTEMPTS = 1000
LOCK_BACKOFF_INITIAL = 0.5
LOCK_BACKOFF_MAX = 10.0

# Every table the toolkit's migrations own (the Core tables mirror them), its version table
# included.
OUTBOX_TABLES = frozenset({*(t.name for t in tables().metadata.sorted_tables), VERSION_TABLE})


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """An ``include_name`` hook for an application's alembic ``env.py``: autogenerate skips
    the toolkit's tables (and their indexes and constraints, which it compares only for tables
    it includes), so it proposes neither dropping nor altering them::

        from outbox.migrate import include_name
        context.configure(connection=connection, target_metadata=metadata,
                          include_name=include_name)

    Tables are told apart by name (:data:`OUTBOX_TABLES`: ``idempotency_keys``, ``outbox``,
    ``outbox_cache_secret``, ``outbox_alembic_version``, ...), in any schema. Combine it with a
    filter of your own as ``lambda *a: include_name(*a) and mine(*a)``.
    """
    return not (type_ == "table" and name in OUTBOX_TABLES)


def include_object(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """The same filter as :func:`include_name`, as an ``include_object`` hook (for an
    ``env.py`` that already filters objects rather than names)."""
    if type_ == "table":
        return name not in OUTBOX_TABLES
    table = getattr(obj, "table", None)
    return table is None or getattr(table, "name", None) not in OUTBOX_TABLES


def _script_location() -> str:
    # Installed wheel: outbox/migrations. Editable/source checkout: <repo>/migrations.
    import importlib

    pkg = importlib.import_module("outbox.migrations")
    return str(Path(pkg.__file__ or "").resolve().parent)


def alembic_config(connection: sa.Connection, schema: str | None = None) -> Config:
    """An alembic ``Config`` bound to ``connection`` and the toolkit's migrations."""
    cfg = Config()
    cfg.set_main_option("script_location", _script_location())
    cfg.attributes["connection"] = connection
    cfg.attributes["outbox_schema"] = validate_schema_name(schema)
    return cfg


def upgrade(
    url_or_engine: str | sa.Engine,
    revision: str = "head",
    schema: str | None = None,
    *,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    lock_attempts: int = DEFAULT_LOCK_ATTEMPTS,
) -> None:
    """Migrate the database up to ``revision`` (default: the latest), one revision per
    transaction; each waits at most ``lock_timeout`` seconds for a lock and is tried up to
    ``lock_attempts`` times (:class:`~outbox.errors.MigrationLockError` after the last)."""
    _run(url_or_engine, schema, revision, True, _lock_limits(lock_timeout, lock_attempts))


def downgrade(
    url_or_engine: str | sa.Engine,
    revision: str,
    schema: str | None = None,
    *,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    lock_attempts: int = DEFAULT_LOCK_ATTEMPTS,
) -> None:
    """Migrate the database down to ``revision`` (``"base"`` removes every table), one
    revision per transaction, with the lock limits of :func:`upgrade`."""
    _run(url_or_engine, schema, revision, False, _lock_limits(lock_timeout, lock_attempts))


def current_revision(connection: sa.Connection, schema: str | None = None) -> str | None:
    """The applied revision, or ``None`` when the toolkit's tables were never migrated."""
    from alembic.migration import MigrationContext

    ctx = MigrationContext.configure(
        connection, opts={"version_table": VERSION_TABLE, "version_table_schema": schema}
    )
    return ctx.get_current_revision()


def head_revision() -> str:
    """The newest revision shipped with this version of the package."""
    cfg = Config()
    cfg.set_main_option("script_location", _script_location())
    head = ScriptDirectory.from_config(cfg).get_current_head()
    assert head is not None
    return head


_REVISION = re.compile(r"[A-Za-z0-9_@+-]{1,64}")
_RELATIVE = re.compile(r"[+-]\d{1,4}")


def check_revision(revision: object) -> str:
    """A revision ``upgrade``/``downgrade`` can reach: ``head``, ``base``, a revision id
    shipped with the package, or a relative step (``+1``, ``-1``); checked before connecting."""
    if not isinstance(revision, str) or not _REVISION.fullmatch(revision):
        raise ConfigurationError(
            f"invalid revision {shown(revision)}: use head, base, a revision id or +N/-N"
        )
    if _RELATIVE.fullmatch(revision):
        return revision
    cfg = Config()
    cfg.set_main_option("script_location", _script_location())
    try:
        ScriptDirectory.from_config(cfg).get_revisions(revision)
    except Exception:
        known = ", ".join(["head", "base", *sorted(_revision_ids(cfg))])
        raise ConfigurationError(
            f"unknown revision {revision!r}: use one of {known} or +N/-N"
        ) from None
    return revision


def _revision_ids(cfg: Config) -> list[str]:
    return [script.revision for script in ScriptDirectory.from_config(cfg).walk_revisions()]


def check_lock_timeout(lock_timeout: object) -> float:
    """A lock timeout in seconds, from 0.001 to :data:`MAX_LOCK_TIMEOUT`."""
    if (
        isinstance(lock_timeout, bool)
        or not isinstance(lock_timeout, int | float)
        or not 0.001 <= lock_timeout <= MAX_LOCK_TIMEOUT
    ):
        raise ConfigurationError(
            f"lock timeout {shown(lock_timeout)}: seconds from 0.001 to {MAX_LOCK_TIMEOUT:g}, "
            "e.g. 2"
        )
    return float(lock_timeout)


def _lock_limits(lock_timeout: object, lock_attempts: object) -> tuple[int, int]:
    """``(milliseconds, attempts)``, checked before connecting."""
    seconds = check_lock_timeout(lock_timeout)
    if type(lock_attempts) is not int or not 1 <= lock_attempts <= MAX_LOCK_ATTEMPTS:
        raise ConfigurationError(
            f"lock attempts {shown(lock_attempts)}: an integer from 1 to {MAX_LOCK_ATTEMPTS}"
        )
    return max(1, round(seconds * 1000)), lock_attempts


def _steps(script: ScriptDirectory, current: str | None, target: str, up: bool) -> list[str]:
    """The targets of one revision each that lead from ``current`` to ``target``; a target
    of another form (``0003+1``, ``heads``) stays one step."""
    order = [s.revision for s in reversed(list(script.walk_revisions()))]
    here = order.index(current) if current in order else -1
    if target in ("head", "heads"):
        there = len(order) - 1
    elif target == "base":
        there = -1
    elif _RELATIVE.fullmatch(target):
        there = here + int(target)
        if not -1 <= there < len(order):
            raise ConfigurationError(
                f"revision {target}: {current or 'base'} has no revision that many steps away"
            )
    elif target in order:
        there = order.index(target)
    else:
        return [target]
    if up and there < here:
        raise ConfigurationError(
            f"revision {target} is below the applied {current}: use --downgrade {target}"
        )
    if up:
        return order[here + 1 : there + 1]
    return [order[i] if i >= 0 else "base" for i in range(here - 1, there - 1, -1)]


def _run(
    url_or_engine: str | sa.Engine,
    schema: str | None,
    revision: str,
    up: bool,
    limits: tuple[int, int],
) -> None:
    engine = (
        sa.create_engine(normalize_database_url(url_or_engine), poolclass=sa.pool.NullPool)
        if isinstance(url_or_engine, str)
        else url_or_engine
    )
    try:
        with engine.connect() as conn:
            script = ScriptDirectory.from_config(alembic_config(conn, schema))
            current = current_revision(conn, validate_schema_name(schema))
            conn.rollback()
        for step in _steps(script, current, revision, up):
            # One transaction per revision: a lock taken by one revision is not held while a
            # later one waits, so writers queue behind at most one lock wait at a time.
            _step(engine, schema, script, step, up, limits)
    finally:
        if isinstance(url_or_engine, str):
            engine.dispose()


def _step(
    engine: sa.Engine,
    schema: str | None,
    script: ScriptDirectory,
    step: str,
    up: bool,
    limits: tuple[int, int],
) -> None:
    """Migrate to ``step`` in one transaction whose statements wait at most the lock timeout;
    on a lock timeout roll back, let the queued writers through, back off and try again."""
    milliseconds, attempts = limits
    backoff = Backoff(LOCK_BACKOFF_INITIAL, LOCK_BACKOFF_MAX)
    for attempt in range(1, attempts + 1):
        try:
            with engine.begin() as conn:
                pg_migrations.set_lock_timeout(conn, milliseconds)
                cfg = alembic_config(conn, schema)
                if up:
                    command.upgrade(cfg, step)
                else:
                    command.downgrade(cfg, step)
            return
        except sa.exc.DBAPIError as exc:
            if not pg_migrations.is_lock_timeout(exc):
                raise
            blockers = _blockers(engine, schema, milliseconds / 1000)
        what = _describe(script, step, up)
        held = (
            "blocked by " + "; ".join(b.describe() for b in blockers)
            if blockers
            else "the session holding the lock ended meanwhile"
        )
        if attempt == attempts:
            pids = ", ".join(str(b.pid) for b in blockers) or "PID"
            raise MigrationLockError(
                f"{what} could not take its lock within {milliseconds} ms in {attempts} "
                f"attempt(s): {held}. End that transaction (SELECT pg_terminate_backend({pids})) "
                "or wait for it to finish, then run outbox migrate again (--lock-timeout, "
                "--lock-attempts)"
            ) from None
        delay = backoff.failed()
        log.warning(
            "%s waited %d ms for its lock (attempt %d of %d), %s; trying again in %.1f s",
            what, milliseconds, attempt, attempts, held, delay,
        )  # fmt: skip
        time.sleep(delay)


def _blockers(
    engine: sa.Engine, schema: str | None, held_seconds: float
) -> list[pg_migrations.Blocker]:
    try:
        with engine.connect() as conn:
            found = pg_migrations.lock_blockers(
                conn, validate_schema_name(schema), OUTBOX_TABLES, held_seconds
            )
            conn.rollback()
    except sa.exc.DBAPIError:
        return []
    return found


def _describe(script: ScriptDirectory, step: str, up: bool) -> str:
    if not up:
        return f"the downgrade to {step}"
    found = script.get_revision(step)
    doc = (found.doc or "").strip().splitlines() if found is not None else []
    return f"revision {step}" + (f" ({doc[0].rstrip('.')})" if doc else "")
