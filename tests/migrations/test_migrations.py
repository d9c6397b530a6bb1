"""Migrations: upgrade, downgrade, no drift from the Core tables, schemas, both entry points."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from outbox import migrate
from outbox.errors import ConfigurationError
from outbox.schema import (
    CACHE_SECRET,
    DLQ_HANDLED,
    RELAY_HELD,
    RELAY_WINDOWS,
    VERSION_TABLE,
    tables,
)

ROOT = Path(__file__).resolve().parents[2]


def _tables(engine: sa.Engine, schema: str | None = None) -> set[str]:
    return set(sa.inspect(engine).get_table_names(schema=schema))


def _drift(engine: sa.Engine, schema: str | None) -> list[object]:
    own = {"idempotency_keys", "outbox", CACHE_SECRET, DLQ_HANDLED, RELAY_WINDOWS, RELAY_HELD}

    def include(obj: object, name: str | None, type_: str, *_: object) -> bool:
        if type_ == "table":
            return name in own
        table = getattr(obj, "table", None)
        return table is None or table.name in own

    with engine.connect() as conn:
        ctx = MigrationContext.configure(
            conn,
            opts={
                "compare_type": True,
                "include_schemas": schema is not None,
                "include_object": include,
                "version_table": VERSION_TABLE,
                "version_table_schema": schema,
            },
        )
        return list(compare_metadata(ctx, tables(schema).metadata))


@pytest.fixture
def empty_engine(engine: sa.Engine) -> sa.Engine:
    migrate.downgrade(engine, "base")
    assert _tables(engine) == set()
    return engine


def test_no_drift_between_core_tables_and_migrations(engine: sa.Engine) -> None:
    # `engine` points at a database migrated to head by the harness.
    assert _drift(engine, None) == []


def test_drift_check_can_fail(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE outbox ADD COLUMN surprise integer"))
    assert _drift(engine, None) != []


def test_upgrade_downgrade_roundtrip(empty_engine: sa.Engine) -> None:
    migrate.upgrade(empty_engine)
    assert _tables(empty_engine) == {
        "idempotency_keys",
        "outbox",
        CACHE_SECRET,
        DLQ_HANDLED,
        RELAY_WINDOWS,
        RELAY_HELD,
        VERSION_TABLE,
    }
    with empty_engine.connect() as conn:
        assert migrate.current_revision(conn) == migrate.head_revision()
    migrate.downgrade(empty_engine, "base")
    assert _tables(empty_engine) == set()  # not even an empty version table is left


def test_version_table_leaves_application_history_alone(empty_engine: sa.Engine) -> None:
    with empty_engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE alembic_version (version_num varchar(32) PRIMARY KEY)"))
        conn.execute(sa.text("INSERT INTO alembic_version VALUES ('app_rev_1')"))
    migrate.upgrade(empty_engine)
    migrate.downgrade(empty_engine, "base")
    with empty_engine.connect() as conn:
        assert (
            conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar() == "app_rev_1"
        )


def test_schema_option(empty_engine: sa.Engine) -> None:
    migrate.upgrade(empty_engine, schema="outbox_schema_1")
    assert _tables(empty_engine, "outbox_schema_1") == {
        "idempotency_keys",
        "outbox",
        CACHE_SECRET,
        DLQ_HANDLED,
        RELAY_WINDOWS,
        RELAY_HELD,
        VERSION_TABLE,
    }
    assert _tables(empty_engine) == set()
    assert _drift(empty_engine, "outbox_schema_1") == []
    import outbox

    with outbox.Outbox(empty_engine, schema="outbox_schema_1") as ob, ob.unit_of_work("k") as uow:
        uow.publish("t", {"a": 1})
    with empty_engine.connect() as conn:
        n = conn.execute(sa.text("SELECT count(*) FROM outbox_schema_1.outbox")).scalar()
    assert n == 1
    migrate.downgrade(empty_engine, "base", schema="outbox_schema_1")
    assert _tables(empty_engine, "outbox_schema_1") == set()


@pytest.mark.parametrize(
    "bad", ["Public", "x;drop table users", "1abc", "pg_catalog", "a" * 64, "", "sch-ema"]
)
def test_bad_schema_names_are_refused(bad: str) -> None:
    with pytest.raises(ConfigurationError, match="invalid schema name"):
        tables(bad)


def _env(database_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env["OUTBOX_DATABASE_URL"] = database_url
    env.pop("OUTBOX_SCHEMA", None)
    return env


def test_alembic_from_repository_root(empty_engine: sa.Engine, database_url: str) -> None:
    alembic = [sys.executable, "-m", "alembic"]
    env = _env(database_url)
    for args in (["upgrade", "head"], ["check"]):
        done = subprocess.run([*alembic, *args], cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    assert "idempotency_keys" in _tables(empty_engine)
    done = subprocess.run(
        [*alembic, "downgrade", "base"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert _tables(empty_engine) == set()


def test_outbox_migrate_command_from_installed_package(
    empty_engine: sa.Engine, database_url: str, tmp_path: Path
) -> None:
    # Run from an unrelated directory: the migrations come from the package, not the checkout.
    cmd = [sys.executable, "-m", "outbox.cli", "migrate", "--database-url", database_url]
    done = subprocess.run(cmd, cwd=tmp_path, env=_env(database_url), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert {"idempotency_keys", "outbox"} <= _tables(empty_engine)
    assert _drift(empty_engine, None) == []
    head = migrate.head_revision()
    assert f"from revision base to {head}" in done.stdout
    again = subprocess.run(
        cmd, cwd=tmp_path, env=_env(database_url), capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr
    assert f"is already at revision {head}: nothing to do" in again.stdout


def test_migrate_command_hides_password_and_fails_clearly(tmp_path: Path) -> None:
    url = "postgresql+psycopg://app:s3cret-pw@127.0.0.1:1/nowhere"
    cmd = [sys.executable, "-m", "outbox.cli", "migrate", "--database-url", url]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "s3cret-pw" not in done.stderr + done.stdout
    assert "outbox: error:" in done.stderr


def test_migrate_command_requires_a_url(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OUTBOX_DATABASE_URL"}
    cmd = [sys.executable, "-m", "outbox.cli", "migrate"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 2
    assert "--database-url is required" in done.stderr
