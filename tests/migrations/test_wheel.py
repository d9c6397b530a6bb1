"""The built wheel carries the migrations: `outbox migrate` works from it alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox import migrate

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_ships_migrations_and_migrates(
    tmp_path: Path, engine: sa.Engine, database_url: str
) -> None:
    # Build from a copy, so the build leaves nothing (build/, *.egg-info) in the checkout.
    source = tmp_path / "src"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "*.egg-info", "build", "__pycache__", ".*cache"
        ),
    )
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("outbox_kit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "outbox/migrations/env.py" in names
    assert "outbox/migrations/versions/0001_initial.py" in names
    assert "outbox/py.typed" in names
    # Every package of the source tree is in the wheel (a missing one breaks `import outbox`).
    packages = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "outbox").rglob("*.py")}
    assert {p for p in packages if f"{p}/__init__.py" not in names} == set()
    assert "outbox/_otel/spans.py" in names and "outbox/testing/delivery.py" in names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    declared = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[pytest11]\noutbox.testing = outbox.testing" in declared

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    migrate.downgrade(engine, "base")
    env = dict(os.environ, PYTHONPATH=str(site))
    code = (
        "import outbox, sys; print(outbox.__file__); sys.exit(__import__('outbox.cli').cli.main())"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, "migrate", "--database-url", database_url],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0].startswith(str(site))  # the wheel's copy ran
    assert {"idempotency_keys", "outbox"} <= set(sa.inspect(engine).get_table_names())
