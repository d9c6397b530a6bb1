"""docs/concepts.md numbers the invariants and names the tests that guard each: they exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONCEPTS = ROOT / "docs" / "concepts.md"
ROW = re.compile(r"^\| (I\d+) \|")
CITED = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def _rows() -> dict[str, list[tuple[str, str]]]:
    rows: dict[str, list[tuple[str, str]]] = {}
    for line in CONCEPTS.read_text().splitlines():
        match = ROW.match(line)
        if match:
            rows[match.group(1)] = CITED.findall(line)
    return rows


def _tests_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    }


def test_every_invariant_is_numbered_once_in_order() -> None:
    assert list(_rows()) == [f"I{n}" for n in range(1, 16)]


def test_every_invariant_names_tests_that_exist() -> None:
    for number, cited in _rows().items():
        assert cited, f"{number} names no test"
        for file, name in cited:
            path = ROOT / file
            assert path.is_file(), f"{number}: {file} does not exist"
            assert name in _tests_of(path), f"{number}: {file} has no {name}"


CITATION = re.compile(r"\bI(?:1[0-5]|[1-9])\b")
POINTED = re.compile(r"docs/concepts\.md[\s#\"(]*I\d+(?:(?:,|,? and|,? or)\s*I\d+)*\b")
ELSEWHERE = "DESIGN" + ".md"  # the file no comment may cite


def test_every_cited_invariant_points_to_docs_concepts() -> None:
    wrong = []
    for path in sorted([*(ROOT / "outbox").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]):
        text = path.read_text()
        pointed = {c.end() + m.start() for m in POINTED.finditer(text)
                   for c in CITATION.finditer(m.group())}  # fmt: skip
        for m in CITATION.finditer(text):
            if m.end() not in pointed:
                wrong.append(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}")
        if ELSEWHERE in text:
            wrong.append(f"{path.relative_to(ROOT)} cites {ELSEWHERE}")
    assert wrong == []
