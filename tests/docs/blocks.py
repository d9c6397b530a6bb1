"""The fenced code blocks of README.md and docs/*.md, as the documentation tests run them.

A block runs unless the last non-blank line before its opening fence is ``<!-- fragment -->``
(or its info string says ``fragment``: ```` ```python fragment ````). ``python`` blocks run as
Python (top-level ``await`` allowed), ``bash`` / ``sh`` blocks under ``bash -euo pipefail``;
blocks of any other language (``console`` transcripts, ``json``, ``sql``, plain text) are shown,
never run. docs/writing-docs.md says the same for the people who write the pages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FRAGMENT = "<!-- fragment -->"
RUNNABLE = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str  # "python", "bash", or the info string's first word for shown blocks
    fragment: bool
    source: str

    @property
    def runs(self) -> bool:
        return self.language in ("python", "bash") and not self.fragment

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """README.md and every docs/*.md page (a new page is picked up without registering it)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        indent, fence = len(match["indent"]), match["fence"]
        words = match["info"].split()
        end = i + 1
        while end < len(lines) and not (
            lines[end].strip().startswith(fence) and lines[end].strip().strip(fence[0]) == ""
        ):
            end += 1
        if end == len(lines):
            raise ValueError(f"{path.name}:{i + 1}: a code block is never closed")
        before = next((ln.strip() for ln in reversed(lines[:i]) if ln.strip()), "")
        body = "\n".join(ln[indent:] if ln[:indent].isspace() else ln for ln in lines[i + 1 : end])
        first = words[0].lower() if words else ""
        found.append(
            Block(
                path=path,
                line=i + 1,
                language=RUNNABLE.get(first, first),
                fragment=before == FRAGMENT or "fragment" in words[1:],
                source=body + "\n",
            )
        )
        i = end + 1
    return found
