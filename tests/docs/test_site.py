"""The documentation site: ``mkdocs build --strict`` passes (no broken link, no docstring the
API reference cannot render), and the API reference names every public name of the package."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.docs.blocks import ROOT

# Modules whose __all__ is public, and public names of modules without one.
PUBLIC_MODULES = [
    "outbox",
    "outbox.consumer",
    "outbox.guard",
    "outbox.http",
    "outbox.http.fastapi",
    "outbox.admin",
    "outbox.testing",
]
PUBLIC_NAMES = {
    "outbox.http.asgi": ["IdempotencyMiddleware"],
    "outbox.http.wsgi": ["IdempotencyMiddleware"],
    "outbox.migrate": ["upgrade", "downgrade", "current_revision", "head_revision",
                       "include_name", "include_object", "OUTBOX_TABLES"],
    "outbox.relay": ["Relay"],
}  # fmt: skip


def public_names() -> set[str]:
    names = {f"{module}.{name}" for module, listed in PUBLIC_NAMES.items() for name in listed}
    for module in PUBLIC_MODULES:
        names.update(f"{module}.{name}" for name in importlib.import_module(module).__all__)
    errors = importlib.import_module("outbox.errors")
    names.update(
        f"outbox.errors.{name}"
        for name, value in vars(errors).items()
        if isinstance(value, type)
        and issubclass(value, Exception)
        and value.__module__ == errors.__name__
    )
    return names


def test_the_api_reference_names_every_public_name() -> None:
    page = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^::: ([\w.]+)$", page, flags=re.MULTILINE))
    missing = sorted(public_names() - documented)
    assert missing == [], f"add to docs/api.md: {', '.join(f'::: {n}' for n in missing)}"


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "outbox.http.fastapi.unit_of_work" in api  # the docstrings were rendered
    home = (tmp_path / "site" / "index.html").read_text()
    headings = re.findall(r"^## (.+)$", (ROOT / "README.md").read_text(), flags=re.MULTILINE)
    assert all(h.replace("`", "") in home for h in headings[:3])  # the home page is README.md


def _self_links(page: Path) -> list[str]:
    text = page.read_text()
    return re.findall(rf"\[[^\]]*\]\({re.escape(page.name)}(?:#[^)]*)?\)", text)


def test_no_page_links_to_itself() -> None:
    found = {p.name: links for p in (ROOT / "docs").glob("*.md") if (links := _self_links(p))}
    assert found == {}, f"a page's own sections are linked as #anchor: {found}"


@pytest.mark.parametrize(
    "link",
    ["missing.md", "../no/such/folder", "home.md#nowhere"],
    ids=["broken", "leaving", "anchor"],
)
def test_the_build_fails_on_a_broken_or_a_leaving_link(tmp_path: Path, link: str) -> None:
    # The project's own settings (strict, validation, the hooks) on a site of two pages.
    settings = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    # Not index.md: the hooks make that one README.md.
    (docs / "home.md").write_text("# Home\n\nSee [the other page](other.md).\n")
    (docs / "other.md").write_text(f"# Other\n\nA [bad link]({link}).\n")
    config = {
        "site_name": "links",
        "docs_dir": str(docs),
        "strict": settings["strict"],
        "validation": settings["validation"],
        "hooks": [str(ROOT / hook) for hook in settings["hooks"]],
        "nav": ["home.md", "other.md"],
    }
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "-d", str(tmp_path / "site")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert link.partition("#")[2 if "#" in link else 0] in output


def test_the_migrations_page_names_every_table() -> None:
    from outbox.migrate import OUTBOX_TABLES

    page = (ROOT / "docs" / "migrations.md").read_text()
    words = {4: "Four", 5: "Five", 6: "Six", 7: "Seven"}
    assert page.split("\n", 3)[2].startswith(f"{words[len(OUTBOX_TABLES)]} tables")
    listed = set(re.findall(r"^\* `(\w+)`", page, flags=re.MULTILINE))
    assert listed == set(OUTBOX_TABLES)
