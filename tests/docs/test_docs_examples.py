"""Every code block of README.md and docs/*.md runs, so a snippet users copy cannot drift.

One test per page: its ``python`` and ``bash`` blocks run in order, in one namespace, against a
database of the page's own and the suite's Redis and broker (tests/docs/prelude.py). A block marked
``<!-- fragment -->`` is not run (docs/writing-docs.md). A failing block names its page and line.
"""

from __future__ import annotations

import ast
import asyncio
import gc
import inspect
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.docs import prelude
from tests.docs.blocks import ROOT, Block, blocks, pages

# A page whose runnable blocks mention one of these needs the broker.
_KAFKA_WORDS = ("bootstrap", "kafka", "outbox-relay", "consume")


def _runnable_pages() -> list[Path]:
    return [page for page in pages() if any(b.runs for b in blocks(page))]


def _run_python(block: Block, namespace: dict[str, Any], loop: asyncio.AbstractEventLoop) -> None:
    code = compile(
        block.source, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True
    )
    result = eval(code, namespace)  # a block with top-level await gives a coroutine
    if inspect.iscoroutine(result):
        loop.run_until_complete(result)


def _run_bash(block: Block, env: dict[str, str]) -> None:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.source],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(
            f"{block.where}: the bash block exited {done.returncode}\n"
            f"--- stdout ---\n{done.stdout}\n--- stderr ---\n{done.stderr}",
            pytrace=False,
        )


@pytest.mark.parametrize("page", _runnable_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_blocks_run(
    page: Path,
    request: pytest.FixtureRequest,
    database_url: str,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runnable = [b for b in blocks(page) if b.runs]
    bootstrap = None
    if any(word in b.source.lower() for b in runnable for word in _KAFKA_WORDS):
        bootstrap = request.getfixturevalue("kafka_bootstrap")
    prelude.create_tables(database_url)
    values = {
        "OUTBOX_DATABASE_URL": database_url,
        "OUTBOX_REDIS_URL": redis_url,
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": bootstrap or "",
        "OUTBOX_GUARD_SECRET": secrets.token_hex(16),  # what docs/guard.md reads
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(ROOT)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    namespace = prelude.namespace(database_url, redis_url, bootstrap)
    loop = asyncio.new_event_loop()
    opened: dict[int, Any] = {}  # a later block may rebind a name: keep every outbox seen
    try:
        for block in runnable:
            if block.language == "bash":
                _run_bash(block, env)
                continue
            try:
                _run_python(block, namespace, loop)
            except Exception as exc:
                raise AssertionError(f"{block.where}: the python block raised {exc!r}") from exc
            finally:
                opened.update(_outboxes(namespace))
    finally:
        loop.run_until_complete(_close(opened.values()))
        loop.close()
        namespace.clear()
        gc.collect()  # anything left unclosed warns here, in this page's test


def _outboxes(namespace: dict[str, Any]) -> dict[int, Any]:
    import outbox
    from outbox import AsyncOutbox, Outbox

    found = {id(v): v for v in namespace.values() if isinstance(v, AsyncOutbox | Outbox)}
    if outbox.uow._default._default is not None:  # outbox.configure() in a block
        found[id(outbox.uow._default._default)] = outbox.uow._default._default
    return found


async def _close(outboxes: Any) -> None:
    """Close what the blocks opened, so the page's database can be dropped quietly."""
    import outbox
    from outbox import AsyncOutbox

    for value in outboxes:
        if isinstance(value, AsyncOutbox):
            await value.close()
        else:
            value.close()
    outbox.uow._default._default = None
