"""deploy/grafana/outbox-kit.json imports into Grafana as it is: a dashboard (not an export
wrapper) whose every query goes to the data source chosen in its ``datasource`` variable, whose
panels fit the grid without overlapping, whose variables are defined where used, and whose
queries are valid PromQL (``promtool check rules`` on them, the variables filled in)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures.common import unavailable

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "outbox-kit.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Grafana's own variables, and values that stand in for them in a PromQL check.
BUILTIN = {"__rate_interval": "5m", "__range": "1h", "__interval": "1m"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    doc = json.loads(DASHBOARD.read_text())
    assert isinstance(doc, dict)
    return doc


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def _variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def test_it_is_a_dashboard_with_a_datasource_variable(dashboard: dict[str, Any]) -> None:
    assert "dashboard" not in dashboard, "an API wrapper, not an importable dashboard"
    assert dashboard["uid"] == "outbox-kit" and dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    variable = _variables(dashboard)["datasource"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"


def test_every_query_uses_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    panels = _panels(dashboard)
    assert len(panels) >= 10
    for panel in panels:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], f"{panel['title']}: no query"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), f"{panel['title']}: refIds repeat"
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]
    for variable in _variables(dashboard).values():
        if variable["type"] == "query":
            assert variable["datasource"] == DATASOURCE, variable["name"]


def test_panels_fit_the_grid_without_overlapping(dashboard: dict[str, Any]) -> None:
    taken: set[tuple[int, int]] = set()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(set(ids)) == len(ids), "panel ids repeat"
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        cells = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def _queries(dashboard: dict[str, Any]) -> list[str]:
    queries = [t["expr"] for p in _panels(dashboard) for t in p["targets"]]
    for variable in _variables(dashboard).values():
        if variable["type"] == "query":
            queries.append(variable["query"]["query"])
    return queries


def test_variables_used_are_defined(dashboard: dict[str, Any]) -> None:
    defined = set(_variables(dashboard)) | set(BUILTIN)
    for query in _queries(dashboard):
        for name in re.findall(r"\$(\w+)", query):
            assert name in defined, f"${name} is not a variable of the dashboard: {query}"


def test_queries_are_valid_promql(dashboard: dict[str, Any], tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        unavailable("promtool", "not on PATH", "apt-get install -y prometheus")
    values = {**BUILTIN, **{name: ".*" for name in _variables(dashboard)}}
    rules = []
    for i, query in enumerate(_queries(dashboard)):
        if query.startswith("label_values("):
            query = query.removeprefix("label_values(").rsplit(",", 1)[0]
        expr = re.sub(r"\$(\w+)", lambda m: values[m.group(1)], query)
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
