"""The unit of work's handle ends itself: no module but its own reaches into its private fields.

Read from the source with ``ast``: the handle's private fields are the ``self._x`` it assigns;
any other module that reads or writes ``<handle>._x`` -- a variable named like a unit of work
(``uow``, ``unit``, ``u``) or an attribute ending in ``_uow`` -- fails the test.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "outbox"
HANDLES = {PACKAGE / "uow" / f"{name}.py" for name in ("_unit_async", "_unit", "_unit_base")}
# The handle's classes: each flavour's, and the base both build on.
CLASSES = {"_unit_async.py": "AsyncUnitOfWork", "_unit_base.py": "UnitBase"}
HANDLE_NAMES = {"uow", "unit", "u"}


def _private_fields() -> set[str]:
    fields: set[str] = set()
    for module, name in CLASSES.items():
        tree = ast.parse((PACKAGE / "uow" / module).read_text(encoding="utf-8"))
        handle = next(
            node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name
        )
        fields |= {
            node.attr
            for node in ast.walk(handle)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        }
    return fields


def _is_handle(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in HANDLE_NAMES
    return isinstance(node, ast.Attribute) and node.attr.endswith("_uow")


def reaches_in(source: str, fields: set[str]) -> list[str]:
    """``<handle>._field`` expressions in ``source``, as ``line: text``."""
    return [
        f"{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and node.attr in fields and _is_handle(node.value)
    ]


def test_the_handle_has_private_fields() -> None:
    assert {"_session", "_tx", "_events", "_stored", "_joined"} <= _private_fields()


def test_a_reach_into_the_handle_is_found() -> None:
    fields = _private_fields()
    assert reaches_in("async def f(uow):\n    await uow._session.flush()\n", fields)
    assert reaches_in("def f(self):\n    self._uow._typed = None\n", fields)
    assert not reaches_in("async def f(uow):\n    await uow.close()\n", fields)


def test_no_module_but_the_handles_reaches_into_it() -> None:
    fields = _private_fields()
    found = {
        str(path.relative_to(PACKAGE.parent)): hits
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in HANDLES and (hits := reaches_in(path.read_text(encoding="utf-8"), fields))
    }
    assert found == {}
