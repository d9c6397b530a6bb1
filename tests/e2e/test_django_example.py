"""The example Django project's own tests pass as its README runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("django")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "django_shop"


def test_the_django_example_tests_pass(database_url: str) -> None:
    server = database_url.rsplit("/", 1)[0] + "/postgres"  # the suite's server
    env = {**os.environ, "OUTBOX_TESTING_DATABASE_URL": server}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider"],
        cwd=EXAMPLE, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "3 passed" in done.stdout
