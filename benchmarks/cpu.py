"""CPU time spent during a benchmark phase, by process group, from Linux's ``/proc``.

On a machine whose cores are all busy, a phase's rate is its cores divided by the CPU time all
its parties spend per record; comparing those budgets (the client, the broker, PostgreSQL and
the machine as a whole) tells where a gap between two rates comes from. Elsewhere than Linux
the meter measures nothing (:func:`available` is false) and the benchmarks leave its lines out.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def available() -> bool:
    return (PROC / "stat").exists()


def _machine_busy() -> int:
    """Clock ticks the machine's cores spent running something: user, nice, system, irq and
    softirq time (not idle, I/O wait or time stolen by a hypervisor; guest time is already
    counted in user time)."""
    if not available():
        return 0
    ticks = [int(f) for f in (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = ticks[:7]
    return user + nice + system + irq + softirq


def _process_ticks(pid: int) -> int:
    """User + system clock ticks of one process (all its threads); 0 once it is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return 0
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def processes_named(name: str) -> list[int]:
    """Pids of the processes whose command name is ``name`` (e.g. every PostgreSQL process)."""
    pids: list[int] = []
    if not available():
        return pids
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == name:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@dataclass
class Usage:
    """CPU milliseconds per group over one phase (and the machine's in all)."""

    groups: dict[str, float]
    machine: float

    def per(self, records: int, per: int = 1000) -> str:
        """``group ms, ...`` per ``per`` records."""
        parts = [f"{name} {ms * per / records:.1f}" for name, ms in self.groups.items()]
        parts.append(f"machine {self.machine * per / records:.1f}")
        return ", ".join(parts)


class Meter:
    """Snapshot CPU ticks of groups of processes at :meth:`start` and :meth:`stop`.

    ``groups`` maps a name to a function returning the group's pids (called at both ends, so
    PostgreSQL's backends can be found afresh); a process that ends between the two snapshots
    is left out of its group, the machine total still counts it.
    """

    def __init__(self, groups: dict[str, Callable[[], Iterable[int]]]) -> None:
        self.groups = groups
        self._start: dict[str, dict[int, int]] = {}
        self._machine = 0

    def _snapshot(self) -> dict[str, dict[int, int]]:
        return {
            name: {pid: _process_ticks(pid) for pid in pids()} for name, pids in self.groups.items()
        }

    def start(self) -> None:
        self._start = self._snapshot()
        self._machine = _machine_busy()

    def stop(self) -> Usage:
        machine = _machine_busy() - self._machine
        end = self._snapshot()
        groups = {}
        for name, ticks in end.items():
            before = self._start.get(name, {})
            spent = sum(t - before[pid] for pid, t in ticks.items() if pid in before)
            groups[name] = spent * 1000 / TICK
        return Usage(groups, machine * 1000 / TICK)
