"""The version a user asks for is the one installed: ``outbox --version``, ``python -m outbox``
and ``outbox.__version__`` agree with the distribution's metadata (written once, in
outbox/__init__.py)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import outbox
from tests.fixtures.relay import REPO


def test_version_is_one_value_everywhere() -> None:
    installed = version("outbox-kit")
    assert outbox.__version__ == installed
    for module in ("outbox", "outbox.cli"):
        command = [sys.executable, "-m", module, "--version"]
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"outbox-kit {installed}"


def test_python_dash_m_outbox_runs_the_outbox_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "outbox", "--help"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "usage: outbox" in done.stdout
    assert "dev" in done.stdout and "migrate" in done.stdout
