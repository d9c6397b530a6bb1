"""deploy/prometheus: the alert rules pass ``promtool check rules`` and their own
``promtool test rules`` cases, every alert has a case that fires and one that stays quiet (and
each case notices when its alert's expression is broken), and every runbook link names a
heading of docs/operations.md.

``promtool`` is Debian's ``prometheus`` package (.ci/run installs it); without it these tests
skip on a laptop and fail under CI=true.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures.common import unavailable

REPO = Path(__file__).resolve().parents[2]
RULES_DIR = REPO / "deploy" / "prometheus"
RULES = RULES_DIR / "outbox-kit-rules.yml"
RULE_TESTS = RULES_DIR / "outbox-kit-rules.test.yml"
OPERATIONS = REPO / "docs" / "operations.md"


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        unavailable(
            "promtool",
            "not on PATH",
            "install Debian's prometheus package: apt-get install -y prometheus",
        )
    return path


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _alerts() -> list[str]:
    return [rule["alert"] for rule in _rules() if "alert" in rule]


def _run(promtool: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *args], capture_output=True, text=True, cwd=cwd, timeout=120, check=False
    )


def test_rules_pass_promtool_check(promtool: str) -> None:
    done = _run(promtool, "check", "rules", RULES.name, cwd=RULES_DIR)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in done.stdout


def test_rules_pass_their_promtool_unit_tests(promtool: str) -> None:
    done = _run(promtool, "test", "rules", RULE_TESTS.name, cwd=RULES_DIR)
    assert done.returncode == 0, done.stdout + done.stderr


def _cases(firing: bool, alert: str) -> list[dict[str, Any]]:
    """The test groups of the rule tests with a firing (or a quiet) case of ``alert``, each
    cut down to its cases of that alert."""
    doc = yaml.safe_load(RULE_TESTS.read_text())
    out = []
    for group in doc["tests"]:
        cases = [
            case
            for case in group.get("alert_rule_test", [])
            if case["alertname"] == alert and bool(case["exp_alerts"]) == firing
        ]
        if cases:
            out.append({**group, "alert_rule_test": cases})
    return out


def _with_expression(tmp_path: Path, alert: str, expr: str, tests: list[dict[str, Any]]) -> Path:
    """Copies of the rules, ``alert``'s expression replaced by ``expr``, and of ``tests``."""
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                rule["expr"] = expr
    (tmp_path / RULES.name).write_text(yaml.safe_dump(doc))
    tests_file = tmp_path / RULE_TESTS.name
    tests_file.write_text(
        yaml.safe_dump({"rule_files": [RULES.name], "evaluation_interval": "1m", "tests": tests})
    )
    return tests_file


@pytest.mark.parametrize("alert", _alerts())
def test_each_alert_has_a_firing_and_a_quiet_case_that_catch_a_broken_expression(
    promtool: str, tmp_path: Path, alert: str
) -> None:
    """The firing case fails when the alert can never fire; the quiet case fails when it
    always fires: each case really tests its alert."""
    firing, quiet = _cases(True, alert), _cases(False, alert)
    assert firing, f"{alert}: no test case where it fires"
    assert quiet, f"{alert}: no test case where it stays quiet"
    for cases, broken, why in (
        (firing, "vector(1) < 0", "never fires"),
        (quiet, 'label_replace(vector(1), "job", "x", "", "")', "always fires"),
    ):
        path = _with_expression(tmp_path, alert, broken, cases)
        done = _run(promtool, "test", "rules", path.name, cwd=tmp_path)
        assert done.returncode != 0, f"{alert}: its cases pass with an expression that {why}"
        assert "FAILED" in done.stdout + done.stderr


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of the headings of ``markdown``."""
    out = set()
    for line in markdown.splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            out.add(text.replace(" ", "-"))
    return out


def test_every_alert_links_a_runbook_heading_of_operations_md() -> None:
    anchors = _anchors(OPERATIONS.read_text())
    for rule in _rules():
        runbook = rule["annotations"]["runbook"]
        page, _, anchor = runbook.partition("#")
        assert page == "docs/operations.md", f"{rule['alert']}: runbook {runbook!r}"
        assert anchor in anchors, f"{rule['alert']}: docs/operations.md has no #{anchor} heading"
        assert anchor == rule["alert"].lower(), f"{rule['alert']}: its own heading, please"
