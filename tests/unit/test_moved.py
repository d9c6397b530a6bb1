"""The import paths of earlier releases: each still imports, warns once, and holds the very
objects of its new home; a path that never existed still fails as before."""

from __future__ import annotations

import importlib
import sys

import pytest

import outbox
from outbox._moved import MOVED


def this_line() -> int:
    return sys._getframe(1).f_lineno


def fresh_import(name: str) -> object:
    sys.modules.pop(name, None)
    vars(outbox).pop(name.rpartition(".")[2], None)
    return importlib.import_module(name)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_holds_the_objects_of_its_new_home(old: str) -> None:
    moved = MOVED[old]
    with pytest.warns(DeprecationWarning, match=rf"{old} has moved: import from {moved.home}"):
        module = fresh_import(old)
    home = importlib.import_module(moved.home)
    names = module.__all__  # type: ignore[attr-defined]
    assert names, f"{old} offers nothing"
    for name in names:
        assert getattr(module, name) is getattr(home, moved.renamed.get(name, name)), name
    assert sys.modules[old] is module


def test_the_warning_points_at_the_importing_line() -> None:
    sys.modules.pop("outbox.uow_async", None)
    with pytest.warns(DeprecationWarning) as caught:
        import outbox.uow_async  # noqa: F401  # why: the import statement is what warns
    assert (caught[0].filename, caught[0].lineno) == (__file__, this_line() - 1)


def test_the_old_from_import_form_works() -> None:
    sys.modules.pop("outbox.uow_batch", None)
    with pytest.warns(DeprecationWarning):
        from outbox.uow_batch import Batch  # why: the form earlier releases documented
    assert Batch is outbox.uow.Batch


@pytest.mark.parametrize("name", ["outbox.no_such_module", "outbox.uow_asyncx", "outbox.Dlq"])
def test_a_path_that_never_existed_still_fails(name: str) -> None:
    with pytest.raises(ModuleNotFoundError, match=name.replace(".", r"\.")):
        importlib.import_module(name)
