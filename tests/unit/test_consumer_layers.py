"""The consumer's layers: a pure core, Kafka and PostgreSQL reached only through their adapters."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import outbox

PACKAGE = Path(outbox.__file__).parent


def imported(path: Path) -> set[str]:
    """Every absolute module name ``path`` imports (``TYPE_CHECKING`` blocks included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_core_imports_only_the_standard_library_and_the_errors() -> None:
    for path in sorted((PACKAGE / "_core").glob("*.py")):
        for name in imported(path):
            allowed = (
                name.split(".")[0] in sys.stdlib_module_names
                or name == "outbox.errors"
                or name.startswith("outbox._core")
            )
            assert allowed, f"outbox/_core/{path.name} imports {name}"


def test_only_the_kafka_adapter_imports_confluent_kafka() -> None:
    for path in sorted(PACKAGE.rglob("*.py")):
        if "confluent_kafka" in {name.split(".")[0] for name in imported(path)}:
            assert path.parent.name == "_kafka", f"{path.relative_to(PACKAGE)} imports it"


@pytest.mark.parametrize(
    "module",
    ["consumer/_runner.py", "consumer/_runner_async.py", "consumer/_metrics.py", "cli/consume.py"],
)
def test_the_consumer_uses_the_adapters_not_the_drivers(module: str) -> None:
    drivers = {"confluent_kafka", "psycopg", "sqlalchemy", "redis"}
    assert not {name for name in imported(PACKAGE / module) if name.split(".")[0] in drivers}


@pytest.mark.parametrize("module", ["consumer/_runner.py", "consumer/_runner_async.py"])
def test_the_runner_has_no_command_line(module: str) -> None:
    names = imported(PACKAGE / module)
    assert "argparse" not in names
    assert not {name for name in names if name.startswith("outbox.cli")}
