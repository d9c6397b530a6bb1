"""Generate the sync twins of the asyncio sources, so each I/O sequence is written once.

Every ``x_async.py`` in a folder of the package is the source of ``x.py`` beside it (one rule,
:func:`pairs`): it is rewritten with the ``RULES`` (regular expressions, applied in order, line
by line), then cleaned with ruff (import order, imports left unused by a rule) and formatted with
ruff, and written under a header naming its source.

    python tools/async_to_sync.py           # regenerate the targets
    python tools/async_to_sync.py --check   # exit 1 when a target differs from what it would be

The run fails when a rule was never used across all pairs: a rule that matches nothing means
the source changed under it, and the twins may have drifted. To generate a new twin, name its
source ``x_async.py`` and add any rule its names need; rules are shared by every pair.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pairs(root: Path = ROOT) -> list[tuple[str, str]]:
    """(asyncio source, generated sync target), relative to ``root``: every ``x_async.py`` in a
    folder of the package is the source of ``x.py`` beside it."""
    return sorted(
        (
            str(source.relative_to(root)),
            str(source.with_name(source.name.removesuffix("_async.py") + ".py").relative_to(root)),
        )
        for source in (root / "outbox").glob("*/**/*_async.py")
    )


@dataclass(frozen=True)
class Rule:
    """Replace ``pattern`` (a regular expression, multi-line mode) with ``replacement``."""

    pattern: str
    replacement: str

    def compiled(self) -> re.Pattern[str]:
        return re.compile(self.pattern, re.MULTILINE)


RULES: list[Rule] = [
    # Names of the asyncio classes and helpers, and their sync twins.
    Rule(r"\bAsyncOutbox\b", "Outbox"),
    Rule(r"\bAsyncUnitOfWork\b", "UnitOfWork"),
    Rule(r"\b_AsyncAttempt\b", "_Attempt"),
    Rule(r"\bAsyncTransaction\b", "Transaction"),
    Rule(r"\bAsyncOutcomeCache\b", "OutcomeCache"),
    Rule(r"\bAsyncKeyReader\b", "KeyReader"),
    Rule(r"\bmake_async_(cache|guard)_client\b", r"make_\1_client"),
    Rule(r"\bdatabase_answers_async\b", "database_answers"),
    Rule(r"\bAsyncRedisGuard\b", "RedisGuard"),
    Rule(r"\bAsyncClaim\b", "Claim"),
    Rule(r"\bAsyncHeartbeat\b", "Heartbeat"),
    Rule(r"\bAsyncRedisClient\b", "RedisClient"),
    Rule(r"\bAsyncClient\b", "Client"),
    Rule(r"\bas_async_client\b", "as_client"),
    Rule(r"\brefuse_undeclared_async\b", "refuse_undeclared"),
    Rule(r"\brun_lanes_async\b", "run_lanes"),
    Rule(r"\bAsyncConsumerRunner\b", "ConsumerRunner"),
    Rule(
        r"\bAsync(Attempts|MicroBatches|JoinedUnits|Outcomes|BaseAttempts|GuardedAttempts"
        r"|DriverSavepoint)\b",
        r"\1",
    ),
    Rule(r"\bAsync(Guarded)?Handler\b", r"\1Handler"),
    Rule(r"\bAsyncKafkaConsumer\b", "KafkaConsumer"),
    Rule(r"\bAsyncDeadLetterProducer\b", "DeadLetterProducer"),
    Rule(r"\b(_?)Async(Batch|BatchUnitOfWork|BatchAttempt|BatchGroup|MessageBatch)\b", r"\1\2"),
    Rule(r"\baob\b", "ob"),
    Rule(r"^_ASYNC = True$", "_ASYNC = False"),
    # Modules that have a twin: ``outbox.<folder>.x_async`` is ``outbox.<folder>.x``.
    Rule(r"\b(outbox(?:\.\w+)+?)_async\b", r"\1"),
    # A connection of the engine's made by the toolkit: the sync one is made in the caller's
    # thread, the asyncio one in SQLAlchemy's greenlet.
    Rule(
        r"\bAsyncConnection\((\w+), await greenlet_spawn\((\w+), \1\.sync_engine\)\)",
        r"\2(\1)",
    ),
    # The language.
    Rule(r"\basync def\b", "def"),
    Rule(r"\basync with\b", "with"),
    Rule(r"\bawait ", ""),
    Rule(r"\b__aenter__\b", "__enter__"),
    Rule(r"\b__aexit__\b", "__exit__"),
    Rule(r"\baclose\b", "close"),
    Rule(r"\bAwaitable\[(\w+)\]", r"\1"),
    Rule(r"\bAbstractAsyncContextManager\b", "AbstractContextManager"),
    # SQLAlchemy.
    Rule(
        r"^from sqlalchemy\.ext\.asyncio import AsyncConnection, AsyncEngine, AsyncSession$",
        "from sqlalchemy import Connection, Engine\nfrom sqlalchemy.orm import Session",
    ),
    Rule(
        r"^from sqlalchemy\.ext\.asyncio import AsyncConnection, AsyncEngine$",
        "from sqlalchemy import Connection, Engine",
    ),
    Rule(r"^from sqlalchemy\.ext\.asyncio import AsyncEngine$", "from sqlalchemy import Engine"),
    Rule(
        r"^from sqlalchemy\.ext\.asyncio import AsyncConnection$",
        "from sqlalchemy import Connection",
    ),
    Rule(
        r"^from sqlalchemy\.ext\.asyncio import AsyncConnection, AsyncSession$",
        "from sqlalchemy import Connection\nfrom sqlalchemy.orm import Session",
    ),
    Rule(r"(?<![.\w])AsyncConnection\b", "Connection"),
    Rule(r"(?<![.\w])AsyncEngine\b", "Engine"),
    Rule(r"(?<![.\w])AsyncSession\b", "Session"),
    Rule(r"\b(\w+)\.sync_(engine|session|connection)\b", r"\1"),
    Rule(r"(\w+) = (\w+)\.get_raw_connection\(\)", r"\1 = \2.connection"),
    # Work after the caller's commit: a task in asyncio, a plain call in the sync flavour.
    Rule(r"^(\s*)spawn\((.+), into=[\w.]+\)$", r"\1\2"),
    # A line that only the asyncio flavour needs (its tasks).
    Rule(r"^.*# asyncio only\n", ""),
    # psycopg.
    Rule(r"\bpsycopg\.Async(Connection|Cursor|Pipeline)\b", r"psycopg.\1"),
    Rule(r"\bAsyncClientCursor\b", "ClientCursor"),
    # redis-py.
    Rule(r"\bredis\.asyncio\b", "redis"),
]

HEADER = "# generated from {source} by tools/async_to_sync.py; do not edit\n"
# The twin's module docstring: what the module does is told once, in its source.
DOCSTRING = '"""Generated from ``{source}`` by ``tools/async_to_sync.py``."""\n'


class UnusedRules(Exception):
    """Rules that matched nothing in any source."""


def convert(text: str, rules: Sequence[Rule], used: dict[Rule, int]) -> str:
    """Apply every rule to ``text``; count each rule's matches in ``used``."""
    for rule in rules:
        text, n = rule.compiled().subn(rule.replacement, text)
        used[rule] = used.get(rule, 0) + n
    return text


def _ruff(args: list[str], text: str, target: Path, root: Path) -> str:
    command = [sys.executable, "-m", "ruff", *args, "--stdin-filename", str(target), "-"]
    try:
        done = subprocess.run(
            command, input=text, capture_output=True, text=True, cwd=root, check=False
        )
    except OSError as exc:  # pragma: no cover - no interpreter
        raise SystemExit(f"cannot run ruff: {exc}") from exc
    if done.returncode != 0:
        raise SystemExit(
            f"ruff {' '.join(args)} failed on the generated {target}:\n{done.stderr}{done.stdout}"
        )
    return done.stdout


def _docstring(text: str, source: str) -> str:
    """``text`` with its module docstring (added when missing) replaced by :data:`DOCSTRING`."""
    tree = ast.parse(text)
    first = tree.body[0] if tree.body else None
    lines = text.splitlines(keepends=True)
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
        and first.end_lineno is not None
    ):
        lines = lines[: first.lineno - 1] + lines[first.end_lineno :]
    else:
        lines = ["\n", *lines]
    return DOCSTRING.format(source=source) + "".join(lines)


def generate(
    pairs: Sequence[tuple[str, str]], rules: Sequence[Rule], root: Path = ROOT
) -> dict[Path, str]:
    """The text of every target; raises :class:`UnusedRules` when a rule matched nothing."""
    used: dict[Rule, int] = {}
    out: dict[Path, str] = {}
    for source, target in pairs:
        text = convert((root / source).read_text(encoding="utf-8"), rules, used)
        path = root / target
        text = _ruff(
            ["check", "--fix", "--select", "I,F401,RUF022", "--quiet", "--exit-zero"],
            text,
            path,
            root,
        )
        text = _ruff(["format", "--quiet"], text, path, root)
        out[path] = HEADER.format(source=source) + _docstring(text, source)
    unused = [rule for rule in rules if not used.get(rule)]
    if unused:
        raise UnusedRules(
            "rules that matched nothing (remove them, or the source changed under them): "
            + ", ".join(repr(rule.pattern) for rule in unused)
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 when a target is stale"
    )
    args = parser.parse_args(argv)
    try:
        targets = generate(pairs(ROOT), RULES, ROOT)
    except UnusedRules as exc:
        print(f"async_to_sync: {exc}", file=sys.stderr)
        return 2
    stale = 0
    for path, text in targets.items():
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current == text:
            continue
        rel = path.relative_to(ROOT)
        if args.check:
            stale += 1
            diff = difflib.unified_diff(
                current.splitlines(keepends=True),
                text.splitlines(keepends=True),
                f"{rel} (on disk)",
                f"{rel} (generated)",
            )
            sys.stderr.writelines(diff)
            print(f"async_to_sync: {rel} is stale", file=sys.stderr)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"async_to_sync: wrote {rel}")
    if stale:
        print("run: python tools/async_to_sync.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
