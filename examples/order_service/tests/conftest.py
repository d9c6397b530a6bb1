"""The order service's tests use nothing but ``outbox.testing`` (loaded by its pytest entry point;
``-p outbox.testing`` where plugin autoloading is off). With no URL set, it starts an embedded
PostgreSQL (``outbox-kit[embedded]``); to use a server of your own:
``OUTBOX_TESTING_DATABASE_URL=postgresql://postgres@127.0.0.1:5432/postgres pytest``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the service's modules

from app import create_tables


@pytest.fixture(scope="session")
def outbox_template_setup() -> Callable[[str], None]:
    """The service's own tables, created once in the template every test database copies."""

    def setup(url: str) -> None:
        engine = sa.create_engine(url)
        try:
            create_tables(engine)
        finally:
            engine.dispose()

    return setup
