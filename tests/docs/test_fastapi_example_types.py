"""The FastAPI examples of README.md and docs/http.md pass ``mypy --strict``: a user who copies
one into a strictly typed project gets no error (the blocks run in test_docs_examples; here they
are type-checked).

The block's top-level ``await`` becomes the body of an ``async def``, and the names the page's
prelude provides (``db_url``, ``redis_url``, ``OrderIn``, ``Order``) are declared with their
types."""

from __future__ import annotations

import textwrap
from pathlib import Path

import mypy.api
import pytest

from tests.docs.blocks import ROOT, blocks

PRELUDE = """\
from pydantic import BaseModel

from tests.docs.prelude import Order

db_url: str = ""
redis_url: str = ""


class OrderIn(BaseModel):
    id: int
    total: int
    sku: str = "book"


async def example() -> None:
"""


@pytest.mark.parametrize("page", ["README.md", "docs/http.md"])
def test_the_fastapi_example_is_mypy_strict_clean(page: str, tmp_path: Path) -> None:
    (block,) = [b for b in blocks(ROOT / page) if "outbox.http.fastapi import" in b.source]
    module = tmp_path / "fastapi_example.py"
    module.write_text(PRELUDE + textwrap.indent(block.source, "    "), encoding="utf-8")
    out, err, status = mypy.api.run(
        ["--strict", "--config-file", str(ROOT / "pyproject.toml"), str(module)]
    )
    assert status == 0, f"{block.where} under mypy --strict:\n{out}{err}"
