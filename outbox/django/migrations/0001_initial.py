"""The toolkit's tables through ``manage.py migrate``: the alembic history, run to its head.

The tables have one history, alembic's (``migrations/`` of the package, version table
``outbox_alembic_version``): this migration runs it, so a database migrated by
``manage.py migrate`` is at the revision ``outbox migrate`` expects, and one migrated by
``outbox migrate`` first only has Django record this migration (alembic finds nothing to do).
A later toolkit release adds a Django migration that runs the history again.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations

from outbox.django._settings import migrate_to_head


def _upgrade(apps: Any, schema_editor: Any) -> None:
    migrate_to_head(schema_editor.connection.alias)


class Migration(migrations.Migration):
    # alembic works on a connection of its own and commits its own steps.
    atomic = False
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [migrations.RunPython(_upgrade, migrations.RunPython.noop)]
