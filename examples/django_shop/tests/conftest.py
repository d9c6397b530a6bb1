"""The shop's tests: Django on a fresh copy of a template database per test, from
``outbox.testing`` (with no URL set it starts an embedded PostgreSQL, ``outbox-kit[embedded]``).
To use a server of your own::

    OUTBOX_TESTING_DATABASE_URL=postgresql://postgres@127.0.0.1:5432/postgres pytest
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import django
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project's modules
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop_project.settings")
django.setup()

pytest_plugins = ["outbox.django.testing"]


@pytest.fixture(scope="session")
def outbox_template_setup(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """The project's own tables, migrated once in the template every test database copies."""
    from outbox.django.testing import template_setup  # the plugin, once pytest loaded it

    return template_setup(request)
