"""Configuration: frozen dataclasses with ``validate()`` and environment helpers.

Invariant: every setting has a default that is safe in production, and ``validate()`` refuses
inconsistent combinations with a message that says how to fix them.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from outbox._core import validate as _validate
from outbox._core.codec import IDEMPOTENCY_HEADER
from outbox._core.deadletter import dead_letter_topic
from outbox._core.durations import (
    DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS,
    check_retention,
    parse_duration,
)
from outbox._core.environment import (  # the table of OUTBOX_* variables
    ENV_CACHE_TTL as ENV_CACHE_TTL,
    ENV_CONSUMER_GROUP as ENV_CONSUMER_GROUP,
    ENV_CONSUMER_METRICS_PORT as ENV_CONSUMER_METRICS_PORT,
    ENV_CONSUMER_TRACE_CONTEXT as ENV_CONSUMER_TRACE_CONTEXT,
    ENV_DATABASE_URL as ENV_DATABASE_URL,
    ENV_GC_BATCH_SIZE as ENV_GC_BATCH_SIZE,
    ENV_GC_DUTY_CYCLE as ENV_GC_DUTY_CYCLE,
    ENV_GUARD_LEASE as ENV_GUARD_LEASE,
    ENV_GUARD_ON_REDIS_ERROR as ENV_GUARD_ON_REDIS_ERROR,
    ENV_GUARD_REDIS_URL as ENV_GUARD_REDIS_URL,
    ENV_GUARD_SECRET as ENV_GUARD_SECRET,
    ENV_KAFKA_BOOTSTRAP as ENV_KAFKA_BOOTSTRAP,
    ENV_KAFKA_CONFIG as ENV_KAFKA_CONFIG,
    ENV_LOG_LEVEL as ENV_LOG_LEVEL,
    ENV_METRICS_HOST as ENV_METRICS_HOST,
    ENV_MIN_REDELIVERY_WINDOW as ENV_MIN_REDELIVERY_WINDOW,
    ENV_POOLER as ENV_POOLER,
    ENV_REDIS_URL as ENV_REDIS_URL,
    ENV_RELAY_BATCH_SIZE as ENV_RELAY_BATCH_SIZE,
    ENV_RELAY_ENGINE as ENV_RELAY_ENGINE,
    ENV_RELAY_LANES as ENV_RELAY_LANES,
    ENV_RELAY_MAX_ATTEMPTS as ENV_RELAY_MAX_ATTEMPTS,
    ENV_RELAY_METRICS_PORT as ENV_RELAY_METRICS_PORT,
    ENV_RELAY_POLL_INTERVAL as ENV_RELAY_POLL_INTERVAL,
    ENV_RELAY_REBALANCE_INTERVAL as ENV_RELAY_REBALANCE_INTERVAL,
    ENV_RETENTION as ENV_RETENTION,
    ENV_SCHEMA as ENV_SCHEMA,
    ENV_WAKEUP_INTERVAL as ENV_WAKEUP_INTERVAL,
)
from outbox._core.fleet import check_member_id
from outbox._core.lanes import DEFAULT_LANES, MAX_LANES as MAX_LANES
from outbox._core.recordsize import DEFAULT_MESSAGE_MAX_BYTES, producer_limit
from outbox._core.redact import redact_kafka_config, redact_url as redact_url
from outbox._core.settings import (
    MAX_TIMEOUT,
    check_bool,
    check_bootstrap_servers,
    check_cache_prefix,
    check_exception_classes,
    check_host,
    check_int,
    check_kafka_config,
    check_port,
    check_seconds,
    check_text_setting,
)
from outbox._core.urls import check_database_url
from outbox._core.validate import shown
from outbox.errors import ConfigurationError, ValidationError
from outbox.schema import validate_schema_name

DEFAULT_SCOPE = "default"
# librdkafka's default message.max.bytes: what the relay's producer can send unless told more.
DEFAULT_MAX_PAYLOAD_BYTES = DEFAULT_MESSAGE_MAX_BYTES
DEFAULT_CACHE_TTL_SECONDS = 24 * 3600.0
DEFAULT_RETENTION_SECONDS = 7 * 24 * 3600.0
_DURATION_FIELDS = ("cache_ttl", "retention", "min_redelivery_window")
# PostgreSQL's bytea (and Kafka's message.max.bytes) cannot go past 1 GiB.
MAX_PAYLOAD_BYTES = 1024 * 1024 * 1024


@dataclass(frozen=True)
class OutboxConfig:
    """Settings of an :class:`outbox.Outbox`.

    ``cache_ttl`` is how long Redis remembers an outcome; it must be shorter than ``retention``,
    how long PostgreSQL keeps idempotency keys (``outbox gc`` deletes older ones), so the cache
    can never answer for a key the database has forgotten.

    ``max_payload_bytes`` is the largest event ``publish()`` accepts, measured as the relay's
    producer measures a record (key, value, headers with ``X-Idempotency-Key``, framing): the
    producer's ``message.max.bytes``. ``None`` (the default) takes it from the relay's
    configuration, ``OUTBOX_KAFKA_CONFIG``, else librdkafka's default of 1,000,000; set it when
    the relay's producer is configured elsewhere (``--kafka-config message.max.bytes=...``).
    :meth:`validate` returns the config with the number filled in.

    ``retention`` must also be at least ``min_redelivery_window`` (7 days): the rule
    ``outbox gc --older-than`` follows, so a retention the configuration accepts is one
    ``outbox gc`` accepts. Durations are seconds or the CLI's strings (``"7d"``, ``"36h"``,
    ``"1d12h"``).
    """

    schema: str | None = None
    cache_ttl: float = DEFAULT_CACHE_TTL_SECONDS
    retention: float = DEFAULT_RETENTION_SECONDS
    cache_prefix: str = "outbox"
    cache_socket_timeout: float = 0.05
    cache_connect_timeout: float = 0.05
    cache_retry_after: float = 5.0
    max_payload_bytes: int | None = None
    permanent_errors: tuple[type[BaseException], ...] = field(default_factory=tuple)
    # After a commit that appended events, wake relays that wait for work with a pg_notify sent
    # from a background thread (outbox._pg.wakeup). Off: relays find new rows at their next poll.
    wake_relays: bool = True
    # Per topic: the serializer of event values and of message keys published to it, of
    # confluent-kafka's shape serializer(obj, SerializationContext) -> bytes (outbox.payloads).
    # A serializer given to publish() wins.
    serializers: Mapping[str, Callable[[Any, Any], bytes | None]] = field(default_factory=dict)
    key_serializers: Mapping[str, Callable[[Any, Any], bytes | None]] = field(default_factory=dict)
    # What stands between the application and PostgreSQL: None (a direct connection, or a
    # pooler in session mode) or "transaction" (PgBouncer and the like in transaction pooling
    # mode: nothing may rely on the session; docs/operations.md, "Connection poolers").
    pooler: str | None = None
    min_redelivery_window: float = DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS

    def __post_init__(self) -> None:
        if isinstance(self.permanent_errors, list):
            object.__setattr__(self, "permanent_errors", tuple(self.permanent_errors))
        for name in _DURATION_FIELDS:
            value = getattr(self, name)
            # "7d": read as outbox gc reads it; validate() refuses what cannot be read.
            if isinstance(value, str):
                with contextlib.suppress(ConfigurationError):
                    object.__setattr__(self, name, parse_duration(value))

    def validate(self) -> OutboxConfig:
        """Refuse a setting of the wrong type, out of range or inconsistent with another one."""
        validate_schema_name(self.schema)
        for name in _DURATION_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str):
                parse_duration(value)  # raises, with the forms it accepts
            check_seconds(name, value)
        check_retention(self.retention, self.cache_ttl, self.min_redelivery_window, config=True)
        check_cache_prefix(self.cache_prefix)
        for name in ("cache_socket_timeout", "cache_connect_timeout"):
            check_seconds(name, getattr(self, name), MAX_TIMEOUT)
        check_seconds("cache_retry_after", self.cache_retry_after, 86400.0)
        if self.max_payload_bytes is not None:
            check_int("max_payload_bytes", self.max_payload_bytes, 1, MAX_PAYLOAD_BYTES)
        check_exception_classes("permanent_errors", self.permanent_errors)
        check_bool("wake_relays", self.wake_relays)
        for name in ("serializers", "key_serializers"):
            _check_serializers(name, getattr(self, name))
        check_pooler("pooler", self.pooler)
        if self.max_payload_bytes is None:
            return replace(self, max_payload_bytes=producer_limit(env(ENV_KAFKA_CONFIG)))
        return self

    @property
    def payload_limit(self) -> int:
        """``max_payload_bytes``, or the relay's producer limit it defaults to (see the class)."""
        if self.max_payload_bytes is not None:
            return self.max_payload_bytes
        return producer_limit(env(ENV_KAFKA_CONFIG))


def _check_serializers(name: str, serializers: object) -> None:
    if not isinstance(serializers, Mapping):
        raise ConfigurationError(
            f"{name} must map topic names to serializers, got {type(serializers).__name__}"
        )
    for topic, serializer in serializers.items():
        try:
            _validate.check_topic(topic)
        except ValidationError as exc:
            raise ConfigurationError(f"{name}: {exc}") from None
        if not callable(serializer):
            raise ConfigurationError(
                f"{name}[{topic!r}] must be callable as serializer(obj, ctx), got "
                f"{type(serializer).__name__}"
            )


POOLERS = ("transaction", "session")


def check_pooler(name: str, value: object) -> None:
    if value is not None and value not in POOLERS:
        raise ConfigurationError(
            f"{name} must be None (a direct connection), 'session' or 'transaction' (a "
            f"connection pooler in that mode), got {shown(value)}"
        )


# The relay's engines (RelayConfig.engine, outbox-relay --engine).
RELAY_ENGINES = ("claim", "window")


@dataclass(frozen=True, repr=False)
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
    # Loopback by default: /metrics and /healthz are for the machine's own scraper and probe.
    # A container probed from outside listens on 0.0.0.0.
    metrics_host: str = "127.0.0.1"
    backoff_initial: float = 0.2
    backoff_max: float = 10.0
    stats_interval: float = 5.0
    shutdown_grace: float = 5.0
    # Where batches come from: "claim" (row locks, a DELETE per delivered row) or "window"
    # (snapshot windows: no row lock, no per-row DELETE; docs/relay.md says when to use which).
    engine: str = "claim"

    def __repr__(self) -> str:
        # The URL's password and the secret Kafka settings never reach a repr (docs/concepts.md
        # I10).
        fields = {**self.__dict__, "database_url": redact_url(self.database_url)}
        if isinstance(self.kafka_config, Mapping):
            fields["kafka_config"] = redact_kafka_config(self.kafka_config)
        return f"RelayConfig({', '.join(f'{k}={v!r}' for k, v in fields.items())})"

    def validate(self) -> RelayConfig:
        check_database_url(self.database_url)
        validate_schema_name(self.schema)
        if not self.bootstrap_servers:
            raise ConfigurationError(
                f"--bootstrap-servers is required (or set {ENV_KAFKA_BOOTSTRAP})"
            )
        check_bootstrap_servers(self.bootstrap_servers, "--bootstrap-servers")
        check_kafka_config(self.kafka_config, "--kafka-config")
        check_int("--batch-size", self.batch_size, 1, 100_000)
        check_int("--lanes", self.lanes, 1, MAX_LANES)
        check_int("--max-attempts", self.max_attempts, 1, 1_000_000)
        for name in ("poll_interval", "rebalance_interval", "backoff_initial", "backoff_max"):
            check_seconds("--" + name.replace("_", "-"), getattr(self, name), MAX_TIMEOUT)
        for name in ("stats_interval", "shutdown_grace"):
            check_seconds(name, getattr(self, name), MAX_TIMEOUT)
        if self.backoff_initial > self.backoff_max:
            raise ConfigurationError(
                f"backoff_initial ({self.backoff_initial:g}s) must not exceed backoff_max "
                f"({self.backoff_max:g}s)"
            )
        check_port("--metrics-port", self.metrics_port)
        check_host("--metrics-host", self.metrics_host)
        if self.engine not in RELAY_ENGINES:
            raise ConfigurationError(
                f"invalid --engine {shown(self.engine)}: use one of {', '.join(RELAY_ENGINES)}"
            )
        return self


# ConsumerConfig.concurrency: at most this many messages in flight, each holding a connection.
MAX_CONCURRENCY = 256

# ConsumerConfig.trace_context: the record's context as the process span's parent, or a link.
TRACE_CONTEXTS = ("parent", "link")


@dataclass(frozen=True, repr=False)
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
    # Messages of a micro-batch per savepoint: more saves a round trip per message, and a
    # handler's failure then rolls back the others of its chunk, which run again in the next
    # micro-batch (docs/consumer.md, "Savepoints").
    savepoint_chunk: int = 1
    # Messages of a micro-batch in flight at once, each in a unit of work (a transaction) of its
    # own: above 1, messages of different Kafka keys in one partition run concurrently, those of
    # one key in offset order (docs/consumer.md, "Concurrency").
    concurrency: int = 1
    # Run a micro-batch's per-message handlers with no savepoint between them and their
    # statements pipelined; a failure gives up the batch, whose messages run again with a
    # savepoint each (docs/consumer.md, "Optimistic batches").
    optimistic: bool = False
    poll_timeout: float = 0.5
    commit_interval: float = 1.0
    # How a message's stored trace context relates to its `process` span (docs/tracing.md):
    # "parent" continues the producer's trace, "link" starts a trace linked to it.
    trace_context: str = "parent"

    def __post_init__(self) -> None:
        # Lenient here, strict in validate(): a malformed value must reach validate() to be
        # refused with a ConfigurationError, not fail construction with a TypeError.
        if isinstance(self.topics, str):
            object.__setattr__(self, "topics", (self.topics,))
        elif isinstance(self.topics, list | tuple | set | frozenset):
            object.__setattr__(self, "topics", tuple(self.topics))
        if isinstance(self.kafka_config, Mapping):
            object.__setattr__(self, "kafka_config", dict(self.kafka_config))

    def __repr__(self) -> str:
        fields = dict(self.__dict__)
        if isinstance(self.kafka_config, Mapping):
            fields["kafka_config"] = redact_kafka_config(self.kafka_config)
        return f"ConsumerConfig({', '.join(f'{k}={v!r}' for k, v in fields.items())})"

    @property
    def effective_scope(self) -> str:
        """The idempotency scope the runner uses: ``scope`` or else the group name."""
        return self.scope or self.group

    @property
    def effective_bootstrap(self) -> str:
        """``bootstrap_servers``, or ``bootstrap.servers`` from ``kafka_config``."""
        value = self.bootstrap_servers
        if not value and isinstance(self.kafka_config, Mapping):
            value = self.kafka_config.get("bootstrap.servers")
        if not value:
            raise ConfigurationError(
                "no Kafka bootstrap servers: pass bootstrap_servers='host:port' "
                f"(CLI: --bootstrap-servers or {ENV_KAFKA_BOOTSTRAP})"
            )
        return str(value)

    def validate(self) -> ConsumerConfig:
        """Refuse inconsistent settings with a message that says how to fix them."""
        if not isinstance(self.topics, tuple):
            raise ConfigurationError(
                f"topics must be a list of topic names, got {type(self.topics).__name__}"
            )
        if not self.topics:
            raise ConfigurationError("no topics to consume: pass topics=['orders', ...]")
        if not isinstance(self.dlq_topic_suffix, str) or not self.dlq_topic_suffix:
            raise ConfigurationError("dlq_topic_suffix must not be empty, e.g. '.dlq'")
        for topic in self.topics:
            _validate.check_topic(topic)
            _validate.check_topic(dead_letter_topic(topic, self.dlq_topic_suffix))
        if not isinstance(self.group, str) or not self.group.strip():
            raise ConfigurationError("group must be a non-empty consumer group name")
        if self.scope is not None and not isinstance(self.scope, str):
            raise ConfigurationError(
                f"scope must be a str or None, got {type(self.scope).__name__}"
            )
        try:
            _validate.check_scope(self.effective_scope)
        except ValidationError as exc:
            raise ConfigurationError(
                f"{exc} -- the scope defaults to the group name; pass scope=... explicitly"
            ) from exc
        kafka_config = check_kafka_config(self.kafka_config)
        check_bootstrap_servers(self.effective_bootstrap)
        _validate.check_header_name(self.key_header, ConfigurationError)
        check_int("max_attempts", self.max_attempts, 1, 1_000_000)
        check_int("batch_size", self.batch_size, 1, 1_000_000)
        check_int("savepoint_chunk", self.savepoint_chunk, 1, 1_000_000)
        check_int("concurrency", self.concurrency, 1, MAX_CONCURRENCY)
        if not isinstance(self.optimistic, bool):
            raise ConfigurationError(
                f"optimistic must be True or False, got {type(self.optimistic).__name__}"
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
            check_seconds(name, getattr(self, name), MAX_TIMEOUT)
        wait = self.batch_wait
        if (
            isinstance(wait, bool)
            or not isinstance(wait, int | float)
            or not 0 <= wait <= self.poll_timeout
        ):
            raise ConfigurationError(
                f"batch_wait must be a number of seconds between 0 and poll_timeout "
                f"({self.poll_timeout:g}s), got {shown(wait)}"
            )
        if self.trace_context not in TRACE_CONTEXTS:
            raise ConfigurationError(
                f"trace_context must be one of {', '.join(TRACE_CONTEXTS)}, "
                f"got {shown(self.trace_context)}"
            )
        auto_commit = str(kafka_config.get("enable.auto.commit", "false")).lower()
        if auto_commit in ("true", "1"):
            raise ConfigurationError(
                "enable.auto.commit must stay false: the runner commits an offset only after "
                "the message's unit of work committed; remove it from kafka_config"
            )
        group_id = kafka_config.get("group.id")
        if group_id is not None and group_id != self.group:
            raise ConfigurationError(
                f"kafka_config group.id={shown(group_id)} disagrees with group="
                f"{shown(self.group)}; pass the group once"
            )
        return self


def normalize_database_url(url: str) -> str:
    """Accept ``postgres://`` and ``postgresql://`` URLs and select the psycopg 3 driver;
    refuse a malformed URL without quoting it (see :mod:`outbox._core.urls`)."""
    return check_database_url(url)


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
    except ValueError:
        raise ConfigurationError(f"{name}={shown(value)} is not an integer") from None


def env_float(name: str, default: _T) -> float | _T:
    """A number from the environment, ``default`` when unset; a clear error when malformed."""
    value = env(name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise ConfigurationError(f"{name}={shown(value)} is not a number") from None
    if not math.isfinite(number):
        raise ConfigurationError(f"{name}={shown(value)} is not a finite number")
    return number


@dataclass(frozen=True, repr=False)
class FleetConfig:
    """Settings of an ``outbox-relay`` process serving many databases (docs/relay.md, "Many
    databases").

    ``relay`` holds the settings every database's relay shares (its ``database_url`` is
    replaced by each database's). The databases are the union of ``database_urls``, the
    URLs in ``databases_file`` (one per line) and the databases of ``discover_url``'s server
    whose names match the ``LIKE`` pattern ``discover_pattern``; the file and the server are
    read again every ``refresh_interval`` seconds. ``member_id`` names this process among the
    fleet's members (stable across restarts: a restarted member gets its databases back);
    members see each other through a lock in ``membership_url`` (by default the discovery
    database, else the first database listed).
    """

    relay: RelayConfig
    database_urls: tuple[str, ...] = ()
    databases_file: str | None = None
    discover_url: str | None = None
    discover_pattern: str | None = None
    member_id: str = ""
    membership_url: str | None = None
    refresh_interval: float = 10.0
    membership_interval: float = 1.0

    def __repr__(self) -> str:
        return (
            f"FleetConfig(relay={self.relay!r}, "
            f"database_urls={[redact_url(u) for u in self.database_urls]!r}, "
            f"databases_file={self.databases_file!r}, "
            f"discover_url={redact_url(self.discover_url) if self.discover_url else None!r}, "
            f"discover_pattern={self.discover_pattern!r}, member_id={self.member_id!r}, "
            f"membership_url="
            f"{redact_url(self.membership_url) if self.membership_url else None!r}, "
            f"refresh_interval={self.refresh_interval!r}, "
            f"membership_interval={self.membership_interval!r})"
        )

    def membership_database(self) -> str:
        """The URL of the database whose locks show the live members."""
        if self.membership_url:
            return self.membership_url
        if self.discover_url:
            return self.discover_url
        if self.database_urls:
            return self.database_urls[0]
        return self.relay.database_url

    def validate(self) -> FleetConfig:
        self.relay.validate()
        for url in (*self.database_urls, self.discover_url, self.membership_url):
            if url is not None:
                check_database_url(url)
        if (self.discover_url is None) != (self.discover_pattern is None):
            raise ConfigurationError(
                "--discover-url and --discover-pattern go together: the server to ask, and the "
                "LIKE pattern of the database names to serve (e.g. 'tenant_%')"
            )
        if self.discover_pattern is not None:
            check_text_setting("--discover-pattern", self.discover_pattern, limit=200)
        if self.databases_file is not None:
            check_text_setting("--databases-file", self.databases_file, limit=4096)
        if not (self.database_urls or self.databases_file or self.discover_url):
            raise ConfigurationError(
                "no database to serve: give --database-url (repeatable), --databases-file or "
                "--discover-url with --discover-pattern"
            )
        try:
            check_member_id(self.member_id)
        except ValueError as exc:
            raise ConfigurationError(f"--member-id: {exc}") from None
        check_seconds("--refresh-interval", self.refresh_interval, MAX_TIMEOUT)
        check_seconds("membership_interval", self.membership_interval, MAX_TIMEOUT)
        return self
