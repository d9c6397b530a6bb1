"""Migration 0006: the table of handled dead letters appears on the way up and goes on the way
down, in the chosen schema, and refuses what the code never writes."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from outbox import admin, migrate
from outbox.schema import DLQ_HANDLED


def _has_table(engine: sa.Engine, schema: str | None = None) -> bool:
    return DLQ_HANDLED in sa.inspect(engine).get_table_names(schema=schema)


def test_the_table_comes_with_0006_and_goes_with_its_downgrade(engine: sa.Engine) -> None:
    assert _has_table(engine)
    with engine.begin() as conn:
        assert admin.mark_handled(conn, "orders.dlq", [(0, 1)], "discarded") == 1
    migrate.downgrade(engine, "0005")
    assert not _has_table(engine)
    with engine.connect() as conn:
        assert migrate.current_revision(conn) == "0005"
    migrate.upgrade(engine)
    assert _has_table(engine)
    with engine.connect() as conn:
        assert admin.read_handled(conn, "orders.dlq") == {}  # a new, empty table


def test_the_table_lives_in_the_chosen_schema(engine: sa.Engine) -> None:
    migrate.downgrade(engine, "base")
    migrate.upgrade(engine, "0005", schema="dlq_schema_1")
    assert not _has_table(engine, "dlq_schema_1")
    migrate.upgrade(engine, schema="dlq_schema_1")
    assert _has_table(engine, "dlq_schema_1") and not _has_table(engine)
    with engine.begin() as conn:
        admin.mark_handled(conn, "o.dlq", [(2, 7)], "redriven", "dlq_schema_1", by="cli x@y")
    with engine.connect() as conn:
        assert admin.read_handled(conn, "o.dlq", "dlq_schema_1") == {(2, 7): "redriven"}
    migrate.downgrade(engine, "0005", schema="dlq_schema_1")
    assert not _has_table(engine, "dlq_schema_1")


def test_the_database_refuses_an_unknown_way_of_handling(engine: sa.Engine) -> None:
    with (
        pytest.raises(sa.exc.IntegrityError, match="outbox_dlq_handled_how_check"),
        engine.begin() as conn,
    ):
        conn.execute(
            sa.text(
                'INSERT INTO outbox_dlq_handled (dlq_topic, partition, "offset", how) '
                "VALUES ('o.dlq', 0, 1, 'ignored')"
            )
        )
