"""Configuration: frozen dataclasses with ``validate()`` and environment helpers.

:class:`OutboxConfig` configures the unit of work, :class:`ConsumerConfig` the consumer runner.

Every setting has a default that is safe in production; ``validate()`` refuses inconsistent
combinations with a message that says how to fix them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from outbox._core import validate as _validate
from outbox._core.codec import IDEMPOTENCY_HEADER
from outbox._core.deadletter import dead_letter_topic
from outbox._core.environment import (  # the table of OUTBOX_* variables
    ENV_CACHE_TTL as ENV_CACHE_TTL,
    ENV_CONSUMER_GROUP as ENV_CONSUMER_GROUP,
    ENV_CONSUMER_METRICS_PORT as ENV_CONSUMER_METRICS_PORT,
    ENV_DATABASE_URL as ENV_DATABASE_URL,
    ENV_GC_BATCH_SIZE as ENV_GC_BATCH_SIZE,
    ENV_KAFKA_BOOTSTRAP as ENV_KAFKA_BOOTSTRAP,
    ENV_KAFKA_CONFIG as ENV_KAFKA_CONFIG,
    ENV_LOG_LEVEL as ENV_LOG_LEVEL,
    ENV_MIN_REDELIVERY_WINDOW as ENV_MIN_REDELIVERY_WINDOW,
    ENV_REDIS_URL as ENV_REDIS_URL,
    ENV_RELAY_BATCH_SIZE as ENV_RELAY_BATCH_SIZE,
    ENV_RELAY_LANES as ENV_RELAY_LANES,
    ENV_RELAY_MAX_ATTEMPTS as ENV_RELAY_MAX_ATTEMPTS,
    ENV_RELAY_METRICS_PORT as ENV_RELAY_METRICS_PORT,
    ENV_RELAY_POLL_INTERVAL as ENV_RELAY_POLL_INTERVAL,
    ENV_RELAY_REBALANCE_INTERVAL as ENV_RELAY_REBALANCE_INTERVAL,
    ENV_RETENTION as ENV_RETENTION,
    ENV_SCHEMA as ENV_SCHEMA,
    ENV_WAKEUP_INTERVAL as ENV_WAKEUP_INTERVAL,
)
from outbox._core.lanes import DEFAULT_LANES, MAX_LANES
from outbox._core.redact import redact_url as redact_url
from outbox.errors import ConfigurationError, ValidationError
from outbox.schema import validate_schema_name

DEFAULT_SCOPE = "default"
DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024
DEFAULT_CACHE_TTL_SECONDS = 24 * 3600.0
DEFAULT_RETENTION_SECONDS = 7 * 24 * 3600.0


@dataclass(frozen=True)
class OutboxConfig:
    """Settings of an :class:`outbox.Outbox`.

    ``cache_ttl`` is how long Redis remembers an outcome; it must be shorter than ``retention``,
    how long PostgreSQL keeps idempotency keys (``outbox gc`` deletes older ones), so the cache
    can never answer for a key the database has forgotten.
    """

    schema: str | None = None
    cache_ttl: float = DEFAULT_CACHE_TTL_SECONDS
    retention: float = DEFAULT_RETENTION_SECONDS
    cache_prefix: str = "outbox"
    cache_socket_timeout: float = 0.05
    cache_connect_timeout: float = 0.05
    cache_retry_after: float = 5.0
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    permanent_errors: tuple[type[BaseException], ...] = field(default_factory=tuple)
    # After a commit that appended events, wake idle relays with a pg_notify sent from a
    # background thread (outbox._pg.wakeup). Off: relays find new rows at their next poll.
    wake_relays: bool = True

    def validate(self) -> OutboxConfig:
        validate_schema_name(self.schema)
        if self.cache_ttl <= 0:
            raise ConfigurationError(f"cache_ttl must be positive, got {self.cache_ttl!r}")
        if self.retention <= 0:
            raise ConfigurationError(f"retention must be positive, got {self.retention!r}")
        if self.cache_ttl >= self.retention:
            raise ConfigurationError(
                f"cache_ttl ({self.cache_ttl:g}s) must be shorter than retention "
                f"({self.retention:g}s): otherwise Redis could replay a key the database has "
                "already forgotten"
            )
        if not self.cache_prefix or any(c in self.cache_prefix for c in "{}"):
            raise ConfigurationError(
                f"cache_prefix must be non-empty and free of braces, got {self.cache_prefix!r}"
            )
        for name in ("cache_socket_timeout", "cache_connect_timeout", "cache_retry_after"):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.max_payload_bytes <= 0:
            raise ConfigurationError(
                f"max_payload_bytes must be positive, got {self.max_payload_bytes!r}"
            )
        for exc_type in self.permanent_errors:
            if not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
                raise ConfigurationError(
                    f"permanent_errors must hold exception classes, got {exc_type!r}"
                )
        return self


@dataclass(frozen=True)
class RelayConfig:
    """Settings of one ``outbox-relay`` process (every field but the backoff and timing ones
    has a CLI flag and an environment variable).

    ``lanes`` must be the same for every relay of one outbox; a relay refuses to start next to
    relays that use another value.
    """

    database_url: str
    bootstrap_servers: str
    schema: str | None = None
    kafka_config: Mapping[str, str] = field(default_factory=dict)
    # Rows per claim. Larger batches spread the per-batch costs (two statements, a commit,
    # a Kafka round trip per round) over more rows: 5000 drained ~20% faster than 1000 in
    # benchmarks/relay.py. It is also the bound on duplicates after a crash.
    batch_size: int = 5000
    poll_interval: float = 1.0
    lanes: int = DEFAULT_LANES
    max_attempts: int = 10
    rebalance_interval: float = 1.0
    metrics_port: int | None = None
    backoff_initial: float = 0.2
    backoff_max: float = 10.0
    stats_interval: float = 5.0
    shutdown_grace: float = 5.0

    def validate(self) -> RelayConfig:
        normalize_database_url(self.database_url)
        validate_schema_name(self.schema)
        if not self.bootstrap_servers:
            raise ConfigurationError(
                f"--bootstrap-servers is required (or set {ENV_KAFKA_BOOTSTRAP})"
            )
        if not 1 <= self.batch_size <= 100_000:
            raise ConfigurationError(
                f"--batch-size must be between 1 and 100000, got {self.batch_size}"
            )
        if not 1 <= self.lanes <= MAX_LANES:
            raise ConfigurationError(f"--lanes must be between 1 and {MAX_LANES}, got {self.lanes}")
        if self.max_attempts < 1:
            raise ConfigurationError(f"--max-attempts must be at least 1, got {self.max_attempts}")
        for name in ("poll_interval", "rebalance_interval", "backoff_initial", "backoff_max"):
            if getattr(self, name) <= 0:
                flag = "--" + name.replace("_", "-")
                raise ConfigurationError(f"{flag} must be positive, got {getattr(self, name)!r}")
        if self.backoff_initial > self.backoff_max:
            raise ConfigurationError(
                f"backoff_initial ({self.backoff_initial:g}s) must not exceed backoff_max "
                f"({self.backoff_max:g}s)"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigurationError(f"--metrics-port must be a TCP port, got {self.metrics_port}")
        return self


@dataclass(frozen=True)
class ConsumerConfig:
    """Settings of a :class:`outbox.consumer.ConsumerRunner`.

    ``kafka_config`` takes any librdkafka property (``session.timeout.ms``, security settings...);
    the connection and security ones also configure the dead-letter producer. ``scope`` defaults
    to ``group``: consumer groups see independent key spaces, so two services consuming the same
    topic each apply every message once.
    """

    topics: tuple[str, ...]
    group: str
    bootstrap_servers: str | None = None
    kafka_config: Mapping[str, Any] = field(default_factory=dict)
    scope: str | None = None
    key_header: str = IDEMPOTENCY_HEADER
    max_attempts: int = 5
    retry_backoff: float = 0.2
    retry_backoff_max: float = 10.0
    in_progress_backoff: float = 0.05
    in_progress_backoff_max: float = 1.0
    dlq_topic_suffix: str = ".dlq"
    dlq_timeout: float = 30.0
    # Messages per poll and per PostgreSQL transaction (a micro-batch), and how long a batch
    # that is not full waits for more after its first message (docs/consumer.md, "Batches").
    batch_size: int = 500
    batch_wait: float = 0.005
    poll_timeout: float = 0.5
    commit_interval: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.topics, str):
            object.__setattr__(self, "topics", (self.topics,))
        else:
            object.__setattr__(self, "topics", tuple(self.topics))
        object.__setattr__(self, "kafka_config", dict(self.kafka_config))

    @property
    def effective_scope(self) -> str:
        """The idempotency scope the runner uses: ``scope`` or else the group name."""
        return self.scope or self.group

    @property
    def effective_bootstrap(self) -> str:
        """``bootstrap_servers``, or ``bootstrap.servers`` from ``kafka_config``."""
        value = self.bootstrap_servers or self.kafka_config.get("bootstrap.servers")
        if not value:
            raise ConfigurationError(
                "no Kafka bootstrap servers: pass bootstrap_servers='host:port' "
                f"(CLI: --bootstrap-servers or {ENV_KAFKA_BOOTSTRAP})"
            )
        return str(value)

    def validate(self) -> ConsumerConfig:
        """Refuse inconsistent settings with a message that says how to fix them."""
        if not self.topics:
            raise ConfigurationError("no topics to consume: pass topics=['orders', ...]")
        for topic in self.topics:
            _validate.check_topic(topic)
            if not self.dlq_topic_suffix:
                raise ConfigurationError("dlq_topic_suffix must not be empty, e.g. '.dlq'")
            _validate.check_topic(dead_letter_topic(topic, self.dlq_topic_suffix))
        if not isinstance(self.group, str) or not self.group.strip():
            raise ConfigurationError("group must be a non-empty consumer group name")
        try:
            _validate.check_scope(self.effective_scope)
        except ValidationError as exc:
            raise ConfigurationError(
                f"{exc} -- the scope defaults to the group name; pass scope=... explicitly"
            ) from exc
        self.effective_bootstrap  # noqa: B018 -- raises when missing
        if not self.key_header:
            raise ConfigurationError("key_header must name a header, e.g. 'X-Idempotency-Key'")
        if self.max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.batch_size < 1:
            raise ConfigurationError(f"batch_size must be at least 1, got {self.batch_size}")
        if not 0 <= self.batch_wait <= self.poll_timeout:
            raise ConfigurationError(
                f"batch_wait must be between 0 and poll_timeout ({self.poll_timeout:g}s), "
                f"got {self.batch_wait!r}"
            )
        for name in (
            "retry_backoff",
            "retry_backoff_max",
            "in_progress_backoff",
            "in_progress_backoff_max",
            "dlq_timeout",
            "poll_timeout",
            "commit_interval",
        ):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"{name} must be positive, got {getattr(self, name)!r}")
        auto_commit = str(self.kafka_config.get("enable.auto.commit", "false")).lower()
        if auto_commit in ("true", "1"):
            raise ConfigurationError(
                "enable.auto.commit must stay false: the runner commits an offset only after "
                "the message's unit of work committed; remove it from kafka_config"
            )
        group_id = self.kafka_config.get("group.id")
        if group_id is not None and group_id != self.group:
            raise ConfigurationError(
                f"kafka_config group.id={group_id!r} disagrees with group={self.group!r}; "
                "pass the group once"
            )
        return self


def normalize_database_url(url: str) -> str:
    """Accept ``postgres://`` and ``postgresql://`` URLs and select the psycopg 3 driver."""
    if not isinstance(url, str) or "://" not in url:
        # Not echoed: a malformed URL cannot be redacted reliably and may hold a password.
        raise ConfigurationError(
            "invalid database URL: expected postgresql+psycopg://user:password@host:5432/dbname"
        )
    scheme, rest = url.split("://", 1)
    if scheme in ("postgres", "postgresql"):
        return "postgresql+psycopg://" + rest
    if scheme != "postgresql+psycopg":
        raise ConfigurationError(
            f"unsupported database URL scheme {scheme!r}: outbox-kit needs PostgreSQL through "
            "psycopg 3 (postgresql+psycopg://...)"
        )
    return url


def env(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Return a non-empty environment variable or ``None``."""
    value = (environ if environ is not None else os.environ).get(name)
    return value or None


_T = TypeVar("_T")


def env_int(name: str, default: _T) -> int | _T:
    """An integer environment variable, ``default`` when unset; a clear error when malformed."""
    value = env(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError as exc:
        raise ConfigurationError(f"{name}={value!r} is not an integer") from exc


def env_float(name: str, default: _T) -> float | _T:
    """A number from the environment, ``default`` when unset; a clear error when malformed."""
    value = env(name)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError as exc:
        raise ConfigurationError(f"{name}={value!r} is not a number") from exc
