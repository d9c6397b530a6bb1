"""The ``outbox`` command: ``migrate``, ``status``, ``gc``, ``parked``, ``consume``, ``dlq``,
``console``, ``dev``.

Invariant: only the module of the command being run is imported, so ``outbox migrate --help``
loads neither the Kafka client nor the runner; ``outbox --help`` lists the others from
:data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from outbox import __version__
from outbox.cli._common import Parser, run

# name -> (module defining `register(subparsers)`, one-line help for `outbox --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "migrate": ("outbox.cli.migrate", "create or upgrade the outbox tables (alembic)"),
    "status": (
        "outbox.cli.status",
        "backlog per topic and lane, parked rows, keys by status, live relays",
    ),
    "gc": ("outbox.cli.gc", "delete idempotency keys older than the retention, in small batches"),
    "parked": ("outbox.cli.parked", "list, retry or discard parked outbox rows"),
    "consume": (
        "outbox.cli.consume",
        "run a handler on Kafka messages, at most once per idempotency key",
    ),
    "dlq": ("outbox.cli.dlq", "list dead letters by failure, redrive them"),
    "console": (
        "outbox.cli.console",
        "serve the web console: backlog, relays, parked events, dead letters, keys",
    ),
    "dev": (
        "outbox.cli.dev",
        "start PostgreSQL, Redis and a Kafka broker for a trial (until Ctrl-C)",
    ),
}


# Commands that do the first of their actions when none is named: `outbox dlq --topic T` lists.
DEFAULT_ACTIONS: dict[str, tuple[str, frozenset[str]]] = {
    "parked": ("list", frozenset({"list", "retry", "discard"})),
    "dlq": ("list", frozenset({"list", "redrive", "discard"})),
}


def with_default_action(argv: Sequence[str]) -> list[str]:
    """``argv`` with the command's default action put in when it names none."""
    argv = list(argv)
    chosen = _chosen(argv)
    if chosen not in DEFAULT_ACTIONS:
        return argv
    at = argv.index(chosen) + 1
    default, actions = DEFAULT_ACTIONS[chosen]
    if at < len(argv) and (argv[at] in actions or argv[at] in ("-h", "--help")):
        return argv
    return [*argv[:at], default, *argv[at:]]


def _chosen(argv: Sequence[str]) -> str | None:
    for arg in argv:
        if not arg.startswith("-"):
            return arg
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``outbox`` parser; the command named in ``argv`` gets its full set of flags."""
    argv = sys.argv[1:] if argv is None else argv
    parser = Parser(
        prog="outbox", description="outbox-kit: migrations, parked rows, consumers, operations"
    )
    parser.add_argument("--version", action="version", version=f"outbox-kit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = _chosen(argv)
    if chosen in COMMANDS:
        importlib.import_module(COMMANDS[chosen][0]).register(sub)
    for name, (_module, help_line) in COMMANDS.items():
        if name not in sub.choices:
            sub.add_parser(name, help=help_line, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``outbox`` console script."""
    argv = with_default_action(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    return run("outbox", args.func, args)
