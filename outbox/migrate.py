"""Apply or revert outbox-kit's migrations from the installed package, beside an app's own history.

Invariant: the toolkit's migrations keep their own version table (``outbox_alembic_version``)
and ship inside the wheel, so ``outbox migrate`` needs no ``alembic.ini``; an application's
``env.py`` passes :func:`include_name` (or :func:`include_object`) to ``context.configure`` so
that its ``alembic revision --autogenerate`` leaves the toolkit's tables alone.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

from outbox._core.validate import shown
from outbox.config import normalize_database_url
from outbox.errors import ConfigurationError
from outbox.schema import VERSION_TABLE, tables, validate_schema_name

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
    url_or_engine: str | sa.Engine, revision: str = "head", schema: str | None = None
) -> None:
    """Migrate the database up to ``revision`` (default: the latest)."""
    _run(url_or_engine, schema, lambda cfg: command.upgrade(cfg, revision))


def downgrade(url_or_engine: str | sa.Engine, revision: str, schema: str | None = None) -> None:
    """Migrate the database down to ``revision`` (``"base"`` removes every table)."""
    _run(url_or_engine, schema, lambda cfg: command.downgrade(cfg, revision))


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


def _run(url_or_engine: str | sa.Engine, schema: str | None, action: object) -> None:
    engine = (
        sa.create_engine(normalize_database_url(url_or_engine), poolclass=sa.pool.NullPool)
        if isinstance(url_or_engine, str)
        else url_or_engine
    )
    try:
        with engine.begin() as conn:
            action(alembic_config(conn, schema))  # type: ignore[operator]
    finally:
        if isinstance(url_or_engine, str):
            engine.dispose()
