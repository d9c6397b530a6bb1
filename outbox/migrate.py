"""Apply or revert outbox-kit's migrations from the installed package.

The migrations ship inside the wheel (``outbox.migrations``), so ``outbox migrate`` works
without the repository's ``alembic.ini``.
"""

from __future__ import annotations

import re
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

from outbox._core.validate import shown
from outbox.config import normalize_database_url
from outbox.errors import ConfigurationError
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
