"""The release check: ``python -m build`` makes an sdist and a wheel without setuptools
warnings, ``twine check --strict`` accepts both, and the wheel installs into a bare virtualenv
(no extra) where ``import outbox`` works and reports the version the metadata carries."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import outbox

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("OUTBOX_RELEASE_CHECK") != "1",
    reason="the release check (a minute and a half: two builds, a virtualenv from the index) "
    "runs with OUTBOX_RELEASE_CHECK=1: make release-check",
)
def test_sdist_and_wheel_build_clean_pass_twine_and_install_bare(tmp_path: Path) -> None:
    # Build from a copy, so the build leaves nothing (build/, *.egg-info) in the checkout.
    source = tmp_path / "src"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "*.egg-info", "build", "dist", "site", "__pycache__", ".*cache",
            ".outbox-*", "node_modules",
        ),
    )  # fmt: skip
    dist = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(dist), str(source)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    output = built.stdout + built.stderr
    assert built.returncode == 0, output[-4000:]
    assert "would be ignored" not in output, "setuptools warns about the package data"
    assert "Warning" not in output.replace("BuildBackendWarning", ""), output[-4000:]
    version = outbox.__version__
    sdist = dist / f"outbox_kit-{version}.tar.gz"
    wheel = dist / f"outbox_kit-{version}-py3-none-any.whl"
    assert sdist.is_file() and wheel.is_file(), sorted(p.name for p in dist.iterdir())

    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(sdist), str(wheel)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr

    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", str(bare)], check=True, timeout=120)
    installed = subprocess.run(
        [str(bare / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    code = (
        "import importlib.util, outbox; "
        "assert importlib.util.find_spec('fastapi') is None; "  # no extra came along
        "print(outbox.__version__, outbox.__file__)"
    )
    ran = subprocess.run(
        [str(bare / "bin" / "python"), "-c", code],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    shown_version, where = ran.stdout.split()
    assert shown_version == version and where.startswith(str(bare))
    cli = subprocess.run(
        [str(bare / "bin" / "outbox"), "--version"], capture_output=True, text=True, timeout=60
    )
    assert cli.stdout.strip() == f"outbox-kit {version}", cli.stderr
