"""Without the ``fastapi`` extra, ``outbox`` imports and ``outbox.http.fastapi`` says which extra
to install (a fresh interpreter in which FastAPI cannot be imported)."""

from __future__ import annotations

import subprocess
import sys

HIDDEN = """
import sys
sys.modules["fastapi"] = None  # as if it were not installed
import outbox, outbox.http
try:
    import outbox.http.fastapi
except ImportError as exc:
    print(type(exc).__name__, exc.name, exc, sep="|")
"""


def test_importing_the_fastapi_module_without_the_extra_names_the_extra() -> None:
    done = subprocess.run(
        [sys.executable, "-c", HIDDEN], capture_output=True, text=True, timeout=60, check=True
    )
    kind, name, message = done.stdout.strip().split("|")
    assert (kind, name) == ("ModuleNotFoundError", "fastapi")
    assert "outbox.http.fastapi needs FastAPI" in message
    assert "pip install 'outbox-kit[fastapi]'" in message
