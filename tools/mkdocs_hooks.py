"""MkDocs hooks: the site's home page is README.md, so the front door is written once.

``docs/index.md`` is a placeholder; at build time its content is README.md with the links
rewritten as seen from ``docs/`` (``docs/x.md`` -> ``x.md``, other repository paths -> ``../``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[1] / "README.md"


def home_page() -> str:
    def link(match: re.Match[str]) -> str:
        target = match.group(1)
        if target.startswith("docs/"):
            return f"]({target.removeprefix('docs/')})"
        if target.startswith(("http:", "https:", "#")):
            return match.group(0)
        return f"](../{target})"

    return re.sub(r"\]\(([^)]+)\)", link, README.read_text(encoding="utf-8"))


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri == "index.md":
        return home_page()
    return markdown
