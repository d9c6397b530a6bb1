"""``manage.py check --database default``: a database the toolkit's migrations have not
reached is reported (``outbox.W001``).

A warning, not an error: ``manage.py migrate`` runs the database checks before it migrates, and
an error would stop the very command that brings the tables up to date.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from django.core import checks

from outbox import migrate
from outbox.django._settings import alias_of, database_url, outbox_settings


@checks.register(checks.Tags.database)
def outbox_tables_migrated(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[Any]:
    alias = alias_of(None)
    if not databases or alias not in databases:
        return []
    schema = outbox_settings().get("SCHEMA")
    engine = sa.create_engine(database_url(alias), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            current = migrate.current_revision(conn, schema)
    except sa.exc.SQLAlchemyError as exc:
        return [checks.Warning(f"could not read the outbox tables' revision: {type(exc).__name__}",
                               id="outbox.W002")]  # fmt: skip
    finally:
        engine.dispose()
    head = migrate.head_revision()
    if current == head:
        return []
    where = f"schema {schema!r} of " if schema else ""
    return [
        checks.Warning(
            f"the outbox tables in {where}database alias {alias!r} are at revision "
            f"{current or 'none (not migrated)'}, not at {head}",
            hint="run `manage.py migrate outbox` (or `outbox migrate`)",
            id="outbox.W001",
        )
    ]
