"""``make test`` (scripts/pytest_tiers.sh) tells how far its two sessions got while they run,
instead of printing nothing until both finished. A stand-in for Python plays pytest: it prints
progress lines and then waits for the test to let it finish (a file, not a sleep)."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

from tests.fixtures.common import wait_for

REPO = Path(__file__).resolve().parents[2]

FAKE_PYTHON = textwrap.dedent(
    """\
    #!/usr/bin/env bash
    # "$PYTHON -m pytest ARGS": a session that got part way, then waits for the release file.
    case " $* " in
        *" tests/integration "*) echo "tests/integration/test_a.py ..F.                [ 40%]" ;;
        *) echo "tests/unit/test_b.py ......                       [ 75%]" ;;
    esac
    while [ ! -e "$RELEASE" ]; do sleep 0.1; done
    exit 0
    """
)


def test_make_test_reports_each_sessions_progress_while_they_run(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    release = tmp_path / "release"
    out = tmp_path / "out"
    env = {**os.environ, "RELEASE": str(release), "OUTBOX_TEST_PROGRESS_EVERY": "1"}
    with out.open("w") as sink:
        run = subprocess.Popen(
            ["bash", str(REPO / "scripts" / "pytest_tiers.sh"), str(python)],
            stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=REPO,
        )  # fmt: skip
    try:
        wait_for(lambda: "40% (1 failed so far)" in out.read_text(), 30, out.read_text())
    finally:
        release.touch()
        run.wait(30)
    line = next(line for line in out.read_text().splitlines() if "failed so far" in line)
    assert line.endswith("tests/integration 40% (1 failed so far) | the other tiers 75%")
