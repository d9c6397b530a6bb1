"""tools/async_to_sync.py: the sync twins are current, and the tool catches stale rules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("async_to_sync", ROOT / "tools/async_to_sync.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["async_to_sync"] = module
    spec.loader.exec_module(module)
    return module


def test_generated_twins_are_current(tool: ModuleType) -> None:
    assert tool.main(["--check"]) == 0


def test_generated_files_name_their_source(tool: ModuleType) -> None:
    pairs = tool.pairs(ROOT)
    assert ("outbox/uow/_outbox_async.py", "outbox/uow/_outbox.py") in pairs
    for source, target in pairs:
        lines = (ROOT / target).read_text(encoding="utf-8").splitlines()
        assert lines[0] == f"# generated from {source} by tools/async_to_sync.py; do not edit"
        assert lines[1] == f'"""Generated from ``{source}`` by ``tools/async_to_sync.py``."""'


def test_every_async_module_in_a_folder_is_the_source_of_the_twin_beside_it(
    tool: ModuleType, tmp_path: Path
) -> None:
    for name in ("outbox/a_async.py", "outbox/pkg/_b_async.py", "outbox/pkg/deep/c_async.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("", encoding="utf-8")
    assert tool.pairs(tmp_path) == [
        ("outbox/pkg/_b_async.py", "outbox/pkg/_b.py"),
        ("outbox/pkg/deep/c_async.py", "outbox/pkg/deep/c.py"),
    ]  # a module at the top of the package is no source: folders hold the twins


def _tree(tmp_path: Path, folder: str = "pkg") -> Path:
    (tmp_path / folder).mkdir(parents=True)
    (tmp_path / folder / "a_async.py").write_text(
        '"""Asyncio code: a long story of what this module does."""\n\n'
        "import asyncio\n\n\nasync def go(x: int) -> int:\n    await asyncio.sleep(0)\n"
        "    return x\n",
        encoding="utf-8",
    )
    return tmp_path


def test_rules_rewrite_and_clean_up_imports(tool: ModuleType, tmp_path: Path) -> None:
    root = _tree(tmp_path)
    rules = [tool.Rule(r"\basync def\b", "def"), tool.Rule(r"\bawait asyncio\.sleep\(0\)\n", "")]
    out = tool.generate([("pkg/a_async.py", "pkg/a.py")], rules, root)
    text = out[root / "pkg/a.py"]
    assert text.startswith("# generated from pkg/a_async.py by tools/async_to_sync.py")
    assert "def go(x: int) -> int:\n    return x\n" in text
    assert "import asyncio" not in text  # left unused by a rule, removed
    assert "a long story" not in text  # the twin's docstring says only where it comes from


def test_a_rule_that_matches_nothing_fails_the_run(tool: ModuleType, tmp_path: Path) -> None:
    root = _tree(tmp_path)
    rules = [tool.Rule(r"\basync def\b", "def"), tool.Rule(r"\bAsyncGone\b", "Gone")]
    with pytest.raises(tool.UnusedRules, match="AsyncGone"):
        tool.generate([("pkg/a_async.py", "pkg/a.py")], rules, root)


def test_check_reports_a_stale_twin(
    tool: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = _tree(tmp_path, "outbox/pkg")
    monkeypatch.setattr(tool, "ROOT", root)
    monkeypatch.setattr(tool, "RULES", [tool.Rule(r"\basync def\b", "def")])
    assert tool.main([]) == 0  # writes the twin
    assert tool.main(["--check"]) == 0
    twin = root / "outbox/pkg/a.py"
    twin.write_text(twin.read_text(encoding="utf-8") + "# edited by hand\n", encoding="utf-8")
    assert tool.main(["--check"]) == 1
    assert "outbox/pkg/a.py is stale" in capsys.readouterr().err
    monkeypatch.setattr(tool, "RULES", [tool.Rule(r"\bnowhere\b", "x")])
    assert tool.main(["--check"]) == 2
