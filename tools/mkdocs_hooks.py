"""MkDocs hooks: the site's home page is README.md, so the front door is written once.

``docs/index.md`` is a placeholder; at build time its content is README.md with the links
rewritten as seen from ``docs/`` (``docs/x.md`` -> ``x.md``).

The site carries only ``docs/``: a link from a page to another file of the repository
(``../examples/order_service``) works where the Markdown is read in the repository, but would
leave the site and break. On the site such a link becomes the path it names, as code, with the
words "in the repository" -- only when that path exists, so a link to a missing file is still a
broken link that fails the build (mkdocs.yml's ``validation``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def _repository_path(target: str) -> str | None:
    """The repository path a link from ``docs/`` names, when it leaves ``docs/`` and exists."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return None
    path = target.split("#", 1)[0]
    resolved = (DOCS / path).resolve()
    if resolved.is_relative_to(DOCS) or not resolved.is_relative_to(ROOT):
        return None
    return str(resolved.relative_to(ROOT)) if resolved.exists() else None


def _outside_links(markdown: str) -> str:
    def replace(match: re.Match[str]) -> str:
        text, target = match.group(1), match.group(2)
        path = _repository_path(target)
        if path is None:
            return match.group(0)
        if text.startswith("`"):  # the text names the path already
            return f"{text} in the repository"
        return f"{text} (`{path}` in the repository)"

    return _LINK.sub(replace, markdown)


def home_page() -> str:
    def link(match: re.Match[str]) -> str:
        text, target = match.group(1), match.group(2)
        if target.startswith("docs/"):
            return f"[{text}]({target.removeprefix('docs/')})"
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            return match.group(0)
        return f"[{text}](../{target})"

    return _LINK.sub(link, README.read_text(encoding="utf-8"))


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri == "index.md":
        markdown = home_page()
    return _outside_links(markdown)
