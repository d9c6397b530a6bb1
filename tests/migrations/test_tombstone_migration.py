"""Migration 0005: outbox.value becomes nullable (tombstones); the way back refuses while a
tombstone waits, and restores NOT NULL once none does."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic.script import ScriptDirectory

from outbox import Outbox, migrate


def _below_0005(engine: sa.Engine) -> str:
    with engine.connect() as conn:
        script = ScriptDirectory.from_config(migrate.alembic_config(conn))
    below = script.get_revision("0005").down_revision
    assert isinstance(below, str)
    return below


def _nullable(engine: sa.Engine) -> bool:
    columns = {c["name"]: c for c in sa.inspect(engine).get_columns("outbox")}
    return bool(columns["value"]["nullable"])


def test_the_downgrade_keeps_waiting_tombstones_and_then_restores_not_null(
    database_url: str, engine: sa.Engine
) -> None:
    assert _nullable(engine)
    ob = Outbox(database_url)
    try:
        with ob.unit_of_work("k") as uow:
            uow.publish("orders", None, key="o-1")
    finally:
        ob.close()
    with pytest.raises(RuntimeError, match="tombstones"):
        migrate.downgrade(engine, _below_0005(engine))
    with engine.connect() as conn:
        # Each revision is its own transaction: the ones above 0005 went down, 0005 stayed.
        assert migrate.current_revision(conn) == "0005"
        assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 1
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM outbox"))
    migrate.downgrade(engine, _below_0005(engine))
    assert not _nullable(engine)
    migrate.upgrade(engine)
    assert _nullable(engine)
