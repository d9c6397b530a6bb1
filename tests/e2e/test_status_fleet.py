"""``outbox status`` over many databases: each database's backlog, parked rows and owner, the
unhealthy ones (down, unmigrated, parked rows) first, one database's trouble never hiding the
others."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.fixtures.common import free_port
from tests.fixtures.postgres import DatabaseFactory
from tests.fixtures.relay import REPO, insert_rows


@pytest.fixture
def three(_database_factory: DatabaseFactory) -> Iterator[list[str]]:
    names = [_database_factory.create() for _ in range(2)]
    empty = f"fleet_status_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(_database_factory.admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{empty}"')
    admin.dispose()
    try:
        yield [*names, empty]
    finally:
        for name in [*names, empty]:
            _database_factory.drop(name)


def status(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    return subprocess.run(
        [sys.executable, "-m", "outbox.cli", "status", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
        check=False,
    )


def test_status_of_many_databases_puts_the_unhealthy_first(
    three: list[str], _database_factory: DatabaseFactory, tmp_path: Path
) -> None:
    fine, parked, empty = three
    engine = sa.create_engine(_database_factory.url_for(parked))
    insert_rows(engine, "orders", [("k1", b"a"), ("k2", b"b")])
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE outbox SET parked_at = now() WHERE key = 'k1'")
    engine.dispose()
    down = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nowhere"
    listing = tmp_path / "databases.txt"
    listing.write_text(
        "\n".join([_database_factory.url_for(n) for n in (fine, parked, empty)] + [down]) + "\n"
    )

    done = status("--databases-file", str(listing), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    rows = report["databases"]
    names = [r["database"].rsplit("/", 1)[1] for r in rows]
    # Down, then unmigrated, then the one with a parked row; the healthy-but-unserved last.
    assert names == ["nowhere", empty, parked, fine], names
    by_name = dict(zip(names, rows, strict=True))
    assert by_name["nowhere"]["state"] == "down" and by_name["nowhere"]["error"]
    assert by_name[empty]["state"] == "unmigrated"
    assert (by_name[parked]["pending"], by_name[parked]["parked"]) == (1, 1)
    assert by_name[fine]["pending"] == 0 and by_name[fine]["state"] == "unserved"
    assert report["unhealthy"] == 4

    text = status("--databases-file", str(listing))
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].startswith("databases: 4, unhealthy: 4"), text.stdout
    assert "nowhere" in lines[3] and "down" in lines[3], text.stdout
