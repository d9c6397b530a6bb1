"""Import paths of earlier releases, still importable, each with a ``DeprecationWarning``.

Invariant: an old path holds the very objects of their new home (``outbox.uow_async.AsyncOutbox
is outbox.uow.AsyncOutbox``), never copies, so ``isinstance`` checks and ``except`` clauses
written against either path agree. ``MOVED`` is the whole table; docs/api.md lists the new homes.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Moved:
    """Where an old module's names live now: ``home`` (a public module) has them under the
    same names, except ``renamed`` (old name -> name in ``home``); ``names`` limits the old
    module to those names (default: ``home.__all__``)."""

    home: str
    renamed: dict[str, str] = field(default_factory=dict)
    names: Sequence[str] | None = None


MOVED: dict[str, Moved] = {
    "outbox.default": Moved(
        "outbox", names=("configure", "default_outbox", "idempotent", "unit_of_work")
    ),
    "outbox.uow_async": Moved("outbox.uow"),
    "outbox.uow_batch": Moved("outbox.uow"),
    "outbox.uow_batch_async": Moved("outbox.uow"),
    "outbox.guard_async": Moved("outbox.guard"),
    "outbox.consumer_async": Moved(
        "outbox.consumer",
        renamed={"consume": "consume_async"},  # the asyncio form of consume
    ),
    "outbox.dlq": Moved(
        "outbox.admin", names=("REDRIVE_HEADER", "Group", "Letter", "read_groups", "redrive")
    ),
    "outbox.parked": Moved(
        "outbox.admin", names=("ParkedRow", "list_parked", "retry_parked", "discard_parked")
    ),
    "outbox.lanes": Moved(
        "outbox.admin",
        names=(
            "DEFAULT_LANES",
            "MAX_LANES",
            "LockRow",
            "RelayInfo",
            "ownership_from_locks",
            "relay_ownership",
        ),
    ),
}


def old_module(name: str) -> types.ModuleType:
    """A module object for the old path ``name``, holding its names taken from their new home."""
    moved = MOVED[name]
    home = importlib.import_module(moved.home)
    names = list(moved.names if moved.names is not None else home.__all__)
    names += [old for old in moved.renamed if old not in names]
    module = types.ModuleType(name, f"Moved: import these names from :mod:`{moved.home}`.")
    for old in names:
        setattr(module, old, getattr(home, moved.renamed.get(old, old)))
    module.__all__ = sorted(names)  # type: ignore[attr-defined]
    return module


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        home = MOVED[spec.name].home
        warnings.warn(
            f"{spec.name} has moved: import from {home} instead "
            f"(the old path goes away in a later release)",
            DeprecationWarning,
            stacklevel=2,  # the import machinery's own frames are skipped
        )
        return old_module(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: :meth:`create_module` filled the module."""


def install() -> None:
    """Answer the old paths, after every other finder had its say (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
