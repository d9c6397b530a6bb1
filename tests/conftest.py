"""Fixtures on real PostgreSQL, Redis and a Kafka-protocol broker.

Each service's fixtures live in its module of ``tests/fixtures/`` (the package docstring says how
a service is found; ``tests/fixtures/kafka.py`` what the Tansu broker does). Services are
resolved lazily: a unit test that asks for none of these fixtures never touches the network.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

# Before anything imports them: the helpers' asserts report their operands like a test's own.
pytest.register_assert_rewrite("tests.fixtures")

from tests.fixtures.common import REPORTS, USED, in_ci  # noqa: E402
from tests.fixtures.hostile import TALLY  # noqa: E402
from tests.fixtures.postgres import FACTORIES  # noqa: E402

# Property-based tests: HYPOTHESIS_PROFILE picks a profile; by default "ci" under CI=true
# (derandomized: the same examples on every run) and "dev" elsewhere. "long" is the run by
# hand with ten times as many examples (docs/development.md says how to run it).
# No deadline: examples talk to real services on shared machines.
_COMMON: dict[str, Any] = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
}
settings.register_profile("dev", max_examples=100, **_COMMON)
settings.register_profile("ci", max_examples=100, derandomize=True, print_blob=True, **_COMMON)
settings.register_profile("long", max_examples=1000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if in_ci() else "dev"))

pytest_plugins = [
    "tests.fixtures.postgres",
    "tests.fixtures.redis",
    "tests.fixtures.kafka",
    "tests.fixtures.proxy",
    "tests.fixtures.pgbouncer",
    "tests.fixtures.uow",
    "tests.fixtures.guard",
    "tests.fixtures.web",
    "tests.fixtures.console",
    "tests.fixtures.tracing",
    "tests.fixtures.pg_cluster",
    "tests.fixtures.relay",
]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Name the services the session used and what a per-test database cost."""
    if TALLY.examples:
        terminalreporter.section("hostile input")
        terminalreporter.write_line(TALLY.summary())
    for title, lines in REPORTS.items():
        terminalreporter.section(title)
        for line in lines:
            terminalreporter.write_line(line)
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


@pytest.fixture(scope="session")
def outbox_databases(pg_admin_url: str) -> Iterator[Any]:
    """outbox.testing's databases (tests/integration/test_testing.py) on the suite's server."""
    from outbox.testing import TemplateDatabases

    databases = TemplateDatabases(pg_admin_url)
    try:
        yield databases
    finally:
        databases.close()
