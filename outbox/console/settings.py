"""What the console reads and who may change things: :class:`ConsoleConfig`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from outbox._core.settings import check_bootstrap_servers, check_seconds
from outbox._core.urls import check_database_url, check_redis_url
from outbox.console import data
from outbox.errors import ConfigurationError
from outbox.schema import validate_schema_name

MIN_TOKEN_LENGTH = 16
MAX_COUNT_BUDGET = 60.0


@dataclass(frozen=True)
class ConsoleConfig:
    """What the console reads and who may change things."""

    database_url: str
    schema: str | None = None
    bootstrap_servers: str | None = None
    redis_url: str | None = None
    admin_token: str | None = field(default=None, repr=False)
    kafka_config: Mapping[str, str] = field(default_factory=dict, repr=False)
    # Dead letters still to handle that one dead-letters page reads (handled ones do not count).
    dead_letters_limit: int = data.MAX_DEAD_LETTERS

    # The longest a page waits for an exact count of the pending rows: a count that took
    # longer is shown as of when it was made, and the next ones run in the background.
    count_budget: float = data.DEFAULT_COUNT_BUDGET

    def validate(self) -> ConsoleConfig:
        check_database_url(self.database_url)
        check_seconds("count_budget", self.count_budget, MAX_COUNT_BUDGET, zero=True)
        if type(self.dead_letters_limit) is not int or not (
            1 <= self.dead_letters_limit <= 10 * data.MAX_DEAD_LETTERS
        ):
            raise ConfigurationError(
                f"dead_letters_limit: an integer from 1 to {10 * data.MAX_DEAD_LETTERS}"
            )
        validate_schema_name(self.schema)
        if self.bootstrap_servers is not None:
            check_bootstrap_servers(self.bootstrap_servers, "bootstrap_servers")
        if self.redis_url is not None:
            check_redis_url(self.redis_url)
        if self.admin_token is not None and (
            len(self.admin_token) < MIN_TOKEN_LENGTH or not self.admin_token.isprintable()
        ):
            raise ConfigurationError(
                f"the admin token must be at least {MIN_TOKEN_LENGTH} printable characters: "
                "make one with `python -c 'import secrets; print(secrets.token_urlsafe())'`"
            )
        return self


ConsoleSettings = ConsoleConfig
"""The earlier name of :class:`ConsoleConfig`, still importable."""
