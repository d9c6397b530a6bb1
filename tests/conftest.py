"""Fixtures on real PostgreSQL, Redis and a Kafka-protocol broker.

Each service's fixtures live in its module of ``tests/fixtures/`` (the package docstring says how
a service is found; ``tests/fixtures/kafka.py`` what the Tansu broker does). Services are
resolved lazily: a unit test that asks for none of these fixtures never touches the network.
"""

from __future__ import annotations

from typing import Any

import pytest

# Before anything imports them: the helpers' asserts report their operands like a test's own.
pytest.register_assert_rewrite("tests.fixtures")

from tests.fixtures.common import USED  # noqa: E402
from tests.fixtures.postgres import FACTORIES  # noqa: E402

pytest_plugins = [
    "tests.fixtures.postgres",
    "tests.fixtures.redis",
    "tests.fixtures.kafka",
    "tests.fixtures.proxy",
    "tests.fixtures.uow",
    "tests.fixtures.guard",
    "tests.fixtures.web",
]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Name the services the session used and what a per-test database cost."""
    if not USED and not FACTORIES:
        return
    terminalreporter.section("outbox test services")
    for name, where in USED.items():
        terminalreporter.write_line(f"{name}: {where}")
    for factory in FACTORIES:
        if factory.create_seconds:
            n = len(factory.create_seconds)
            create_ms = 1000 * sum(factory.create_seconds) / n
            drop_ms = 1000 * sum(factory.drop_seconds) / max(1, len(factory.drop_seconds))
            terminalreporter.write_line(
                f"per-test database: {n} created, mean create {create_ms:.1f} ms, "
                f"mean drop {drop_ms:.1f} ms (template {factory.template_seconds * 1000:.0f} ms)"
            )
