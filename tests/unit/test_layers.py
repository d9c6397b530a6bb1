"""The package's import graph: layers point one way, no cycles, each library in its adapter.

Read from the source with ``ast`` (no import side effects): module-level imports, imports inside
functions and ``TYPE_CHECKING`` blocks, and module names given to ``importlib`` as strings all
count as edges.

    _core, errors            pure decisions and exceptions (standard library only)
    schema, config           the tables and the settings
    _pg, _redis, _kafka,     adapters, each the only importer of its library
    _otel                    (_otel: opentelemetry, loaded only when importable)
    services                 uow, guard, relay, admin, consumer, http, console, testing, ...
    cli                      the commands, on top

Among the services, the folders are ranked too (``SERVICE_RANK``): the consumer builds on units
of work and the guard, neither of those on the consumer, the relay and the operations (admin) on
none of them; the HTTP door and the console sit above those, the users' test helpers on top.

A folder imports another folder only through its face (``__init__.py``) or its public
submodules; the shared private layers (``_core``, ``_pg``, ``_redis``, ``_kafka``, ``_otel``)
are the one exception, open to every layer above them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "outbox"

BASE_RANK = {"core": 0, "schema": 1, "adapter": 2, "service": 3, "facade": 4, "cli": 5}
# Libraries that only one adapter may import (the guard's Lua scripts live in _redis as well).
CONFINED = {
    "psycopg": "outbox._pg",
    "confluent_kafka": "outbox._kafka",
    "redis": "outbox._redis",
    "opentelemetry": "outbox._otel",
    "django": "outbox.django",
}
# Each says why; today: optional serializers, the embedded servers (two), the dead letters' Kafka
# client (so `outbox status`, `gc` and `parked` never load it).
MAX_LOCAL_IMPORTS = 4
# The service folders: a folder imports only folders of a lower rank.
SERVICE_RANK = {
    "uow": 0,
    "guard": 0,
    "relay": 0,
    "admin": 0,
    "consumer": 1,
    "http": 1,
    "console": 1,
    "testing": 2,
    "django": 2,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer(module: str) -> str:
    parts = module.split(".")
    if module == "outbox":
        return "facade"
    second = parts[1]
    if second in ("_core", "errors"):
        return "core"
    if second in ("schema", "config"):
        return "schema"
    if second in ("_pg", "_redis", "_kafka", "_otel"):
        return "adapter"
    if second in ("cli", "__main__") or module.startswith("outbox.django.management."):
        return "cli"  # `python -m outbox` and Django's management commands are commands too
    return "service"


def service_folder(module: str) -> str | None:
    """The service folder ``module`` is in (its package or a module inside), or None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SERVICE_RANK else None


@dataclass(frozen=True)
class Edge:
    source: str
    target: str  # a module of the package, or a top-level library name
    line: int
    local: bool  # inside a function
    comment: str  # the source line's text, for the "why" of a local import


def _resolve(source: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = source.split(".")
    if MODULES[source].name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _dynamic(tree: ast.AST) -> set[int]:
    """Nodes naming modules imported by name: ``import_module("...")`` arguments and the
    CLI's command table."""
    named: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "import_module" and node.args:
                named.add(id(node.args[0]))
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "COMMANDS" for t in targets):
                named.update(id(n) for n in ast.walk(node))
    return named


def _targets(source: str, node: ast.AST, dynamic: set[int]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
    elif isinstance(node, ast.ImportFrom):
        base = _resolve(source, node)
        for alias in node.names:
            candidate = f"{base}.{alias.name}"
            yield candidate if candidate in MODULES else base
    elif isinstance(node, ast.Constant) and id(node) in dynamic and node.value in MODULES:
        yield node.value


def edges() -> list[Edge]:
    found: list[Edge] = []
    for source, path in MODULES.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        local_nodes: set[int] = set()
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                local_nodes.update(id(n) for n in ast.walk(fn) if n is not fn)
        dynamic = _dynamic(tree)
        for node in ast.walk(tree):
            for target in _targets(source, node, dynamic):
                line = getattr(node, "lineno", 0)
                found.append(Edge(source, target, line, id(node) in local_nodes, lines[line - 1]))
    return found


EDGES = edges()
INTERNAL = [e for e in EDGES if e.target.startswith("outbox") and e.target in MODULES]


def test_the_graph_was_read() -> None:
    assert len(MODULES) > 30 and len(INTERNAL) > 60
    assert any(
        e.source == "outbox.uow._outbox" and e.target == "outbox._pg.transaction" for e in INTERNAL
    )
    assert {service_folder(m) for m in MODULES} >= set(SERVICE_RANK)


def test_no_import_cycle() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for e in INTERNAL:
        if e.target != e.source:
            graph[e.source].add(e.target)
    # A submodule import also runs its package's __init__; the facade's imports of its own
    # submodules are the one expected back-edge of that kind, so packages count only by their
    # own imports (as listed above).
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_layers_point_one_way() -> None:
    wrong = [
        f"{e.source} ({layer(e.source)}) imports {e.target} ({layer(e.target)}) at line {e.line}"
        for e in INTERNAL
        if BASE_RANK[layer(e.target)] > BASE_RANK[layer(e.source)]
    ]
    assert wrong == []


def test_service_folders_point_one_way() -> None:
    wrong = [
        f"{e.source} imports {e.target} at line {e.line}"
        for e in INTERNAL
        if (source := service_folder(e.source)) is not None
        and (target := service_folder(e.target)) is not None
        and source != target
        and SERVICE_RANK[target] >= SERVICE_RANK[source]
    ]
    assert wrong == []


# The folders every layer above them shares privately: a module anywhere may import their
# modules. Every other folder of the package is reached from outside only through its face (its
# __init__.py) or a public submodule (no ``_`` in the path below the folder).
SHARED_PRIVATE = {"_core", "_pg", "_redis", "_kafka", "_otel"}
# Sources of generated twins that must import another folder's private module because the twin
# rule (tools/async_to_sync.py) maps the module itself: none today -- the names a face exports
# are renamed by the rules, so a twin imports the sync names from the same face.
TWIN_PRIVATE_IMPORTS: dict[str, set[str]] = {}


def folder_of(module: str) -> str | None:
    """The folder (a package directly under outbox/) that ``module`` is in, or None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else None


def through_the_face(edge: Edge) -> bool:
    target = folder_of(edge.target)
    if target is None or target in SHARED_PRIVATE or target == folder_of(edge.source):
        return True
    below = edge.target.split(".")[2:]
    if not any(part.startswith("_") for part in below):
        return True
    source = edge.source.removesuffix("_async")
    allowed = TWIN_PRIVATE_IMPORTS.get(source, set())
    return edge.target.removesuffix("_async") in allowed


def test_a_folder_imports_another_only_through_its_face() -> None:
    wrong = [f"{e.source} imports {e.target} at line {e.line}" for e in INTERNAL
             if not through_the_face(e)]  # fmt: skip
    assert wrong == []


def test_the_face_rule_sees_a_private_import() -> None:
    reach = Edge("outbox.testing.delivery", "outbox.consumer._attempt", 1, False, "")
    face = Edge("outbox.testing.delivery", "outbox.consumer", 1, False, "")
    inside = Edge("outbox.consumer._runner", "outbox.consumer._attempt", 1, False, "")
    shared = Edge("outbox.consumer._runner", "outbox._pg.errors", 1, False, "")
    public = Edge("outbox.django.middleware", "outbox.http.asgi", 1, False, "")
    assert not through_the_face(reach)
    assert all(map(through_the_face, [face, inside, shared, public]))


def test_adapters_do_not_import_each_other() -> None:
    wrong = [
        f"{e.source} imports {e.target} at line {e.line}"
        for e in INTERNAL
        if layer(e.source) == layer(e.target) == "adapter"
        and e.source.split(".")[1] != e.target.split(".")[1]
    ]
    assert wrong == []


def test_core_uses_the_standard_library_only() -> None:
    wrong = [
        f"{e.source} imports {e.target} at line {e.line}"
        for e in EDGES
        if layer(e.source) == "core"
        and not e.target.startswith("outbox")
        and e.target.split(".")[0] not in sys.stdlib_module_names
        and e.target.split(".")[0] != "__future__"
    ]
    assert wrong == []


def test_each_library_is_imported_by_its_adapter_only() -> None:
    wrong = [
        f"{e.source} imports {e.target} at line {e.line}"
        for e in EDGES
        if e.target.split(".")[0] in CONFINED
        and not e.source.startswith(CONFINED[e.target.split(".")[0]])
    ]
    assert wrong == []


def test_few_function_local_imports_and_each_says_why() -> None:
    local = {(e.source, e.line): e for e in INTERNAL if e.local}.values()
    assert len(local) <= MAX_LOCAL_IMPORTS, [f"{e.source}:{e.line}" for e in local]
    for e in local:
        assert "#" in e.comment, f"{e.source}:{e.line} imports {e.target} locally without a why"


@pytest.mark.parametrize("command", ["migrate", "status", "gc", "parked"])
def test_operator_commands_do_not_load_the_kafka_client(command: str) -> None:
    probe = (
        "import sys\n"
        "from outbox.cli import main\n"
        "try:\n"
        f"    main([{command!r}, '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('confluent_kafka' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout
    assert "usage: outbox" in out.stdout


MAPPED_FOLDERS = ["uow", "guard", "consumer", "relay", "admin", "http", "console", "testing"]


def test_the_development_map_names_every_module_of_the_service_folders() -> None:
    lines = (PACKAGE.parent / "docs" / "development.md").read_text().splitlines()
    unnamed = []
    for folder in MAPPED_FOLDERS:
        # The folder's entry: its line and the more deeply indented ones below it.
        start = next(i for i, line in enumerate(lines) if line.startswith(f"  {folder}/ "))
        end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("   "))
        layout = "\n".join(lines[start:end])
        for path in sorted((PACKAGE / folder).iterdir()):
            name = path.name
            twin = path.with_name(path.stem + "_async.py")
            if name in ("__init__.py", "__pycache__") or twin.exists():
                continue  # the face, and generated twins (the map names their sources)
            if name not in layout and f"{name}/" not in layout:
                unnamed.append(f"{folder}/{name}")
    assert unnamed == []
