"""The documentation tests' reading of a page: which blocks run and which are fragments."""

from __future__ import annotations

from pathlib import Path

from tests.docs.blocks import ROOT, blocks, pages

PAGE = """# A page

```python
x = 1
```

<!-- fragment -->
```python
import myservice
```

```python fragment
also_not_run()
```

<!-- fragment -->

```bash
echo a blank line between the marker and the fence is allowed
```

```console
$ outbox status
```

- a list item with a block:

  ```sh
  outbox status
  ```
"""


def test_fragments_are_marked_by_the_comment_or_the_info_string(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    found = blocks(page)
    assert [(b.language, b.fragment) for b in found] == [
        ("python", False),
        ("python", True),
        ("python", True),
        ("bash", True),
        ("console", False),
        ("bash", False),
    ]
    assert [b.runs for b in found] == [True, False, False, False, False, True]
    assert found[0].source == "x = 1\n" and found[0].line == 3
    assert found[-1].source == "outbox status\n"  # the list item's indent is removed


def test_every_docs_page_is_collected_without_registration() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in pages()}
    on_disk = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("**/*.md")}
    assert on_disk <= names and "README.md" in names
