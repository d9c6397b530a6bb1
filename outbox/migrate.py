"""Apply or revert outbox-kit's migrations from the installed package.

The migrations ship inside the wheel (``outbox.migrations``), so ``outbox migrate`` works
without the repository's ``alembic.ini``.
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from outbox.config import normalize_database_url
from outbox.schema import VERSION_TABLE, validate_schema_name


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
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", _script_location())
    head = ScriptDirectory.from_config(cfg).get_current_head()
    assert head is not None
    return head


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
