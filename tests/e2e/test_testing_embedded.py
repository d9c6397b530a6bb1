"""``outbox.testing`` with no server configured: a user's ``pytest`` (here with two pytest-xdist
workers) gets its migrated databases on one embedded PostgreSQL, shared by the workers and
stopped when the last of them exits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

USER_TESTS = textwrap.dedent(
    """
    import os

    import pytest
    import sqlalchemy as sa


    @pytest.mark.parametrize("n", range(6))
    def test_each_test_has_a_migrated_database_of_its_own(outbox_database_url, outbox, n):
        assert "host=" in outbox_database_url  # the embedded server's socket
        with outbox.unit_of_work(f"k-{n}") as uow:
            uow.publish("t", {"n": n})
        engine = sa.create_engine(outbox_database_url)
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 1
            version = conn.execute(sa.text("SHOW server_version_num")).scalar_one()
            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            pid = conn.execute(sa.text("SELECT pg_postmaster_start_time()")).scalar_one()
        engine.dispose()
        with open(os.environ["USER_TESTS_REPORT"], "a") as report:
            report.write(f"server {version} {pid} on {worker}\\n")
        assert int(version) >= 180000
    """
)


@pytest.mark.slow
def test_user_tests_run_on_one_embedded_server_shared_by_xdist_workers(
    tmp_path: Path, embedded_home: Path
) -> None:
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    pgdata = embedded_home / "pg"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["OUTBOX_TESTING_EMBEDDED_DIR"] = str(pgdata)
    env.pop("PYTEST_ADDOPTS", None)
    report = tmp_path / "report.txt"
    env["USER_TESTS_REPORT"] = str(report)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "outbox.testing", "-n", "2", "-q",
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_user.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "6 passed" in done.stdout
    lines = report.read_text().splitlines()
    assert len(lines) == 6
    servers = {line.split(" on ")[0] for line in lines}
    workers = {line.split(" on ")[1] for line in lines}
    assert len(servers) == 1, f"one server for every worker: {servers}"
    assert workers == {"gw0", "gw1"}, workers
    assert (pgdata / "PG_VERSION").read_text().strip() == "18"
    assert not (pgdata / "postmaster.pid").exists(), "the embedded server outlived the run"
