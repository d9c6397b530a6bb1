"""librdkafka configuration, built in one place for every client the package creates.

Invariant: both producers -- the relay's and the consumer runner's dead-letter producer -- are
idempotent with ``acks=all``; they differ in what they do with a setting that would weaken that
and in their defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from outbox._core.redact import redact
from outbox.errors import ConfigurationError

Purpose = Literal["relay", "dead-letter"]

# Settings the delivery guarantees depend on. The relay refuses overrides that weaken them; the
# dead-letter producer, built from a consumer's settings, sets them over whatever was given.
REQUIRED_CONFIG: Mapping[str, str] = {
    "enable.idempotence": "true",
    "acks": "all",
}

# The relay sends many records of one key at once: a failed record must never be followed by a
# later one of its partition (see outbox._kafka.producer, "No gaps").
RELAY_REQUIRED_CONFIG: Mapping[str, str] = {
    **REQUIRED_CONFIG,
    "enable.gapless.guarantee": "true",
}

# Defaults of the relay's producer a user may override with --kafka-config.
DEFAULT_CONFIG: Mapping[str, str] = {
    "partitioner": "murmur2_random",  # the Java client's partitioner: same key, same partition
    "linger.ms": "5",
    "batch.num.messages": "10000",
    "queue.buffering.max.messages": "200000",
    "compression.type": "none",
    "message.timeout.ms": "30000",
    "socket.keepalive.enable": "true",
    "reconnect.backoff.ms": "100",
    "reconnect.backoff.max.ms": "2000",
    # librdkafka's own stderr lines repeat what error_cb reports (rate-limited, structured).
    "log_level": "2",
}

# librdkafka properties that only a consumer understands: the dead-letter producer is built from
# the runner's kafka_config without them (a producer would log a warning for each).
CONSUMER_ONLY_PREFIXES = ("group.", "fetch.", "queued.", "auto.", "enable.auto.")
CONSUMER_ONLY = frozenset(
    {
        "session.timeout.ms",
        "heartbeat.interval.ms",
        "max.poll.interval.ms",
        "partition.assignment.strategy",
        "isolation.level",
        "enable.partition.eof",
        "check.crcs",
        "coordinator.query.interval.ms",
        "consume.callback.max.messages",
        "offset.store.method",
        "on_commit",
    }
)


def producer_config(
    bootstrap_servers: str,
    overrides: Mapping[str, Any],
    *,
    purpose: Purpose = "relay",
    client_id: str = "outbox-relay",
) -> dict[str, Any]:
    """The librdkafka configuration of a producer.

    ``purpose="relay"``: ``overrides`` (``--kafka-config``) win over :data:`DEFAULT_CONFIG`, so
    TLS/SASL and tuning work, but they may not turn off idempotence or ``acks=all``, nor make
    delivery unbounded or transactional: the relay's no-loss and order guarantees rest on them.

    ``purpose="dead-letter"``: ``overrides`` are a consumer runner's ``kafka_config``. Its
    connection and security settings carry over, consumer-only properties are dropped, and
    idempotence and ``acks=all`` are set whatever it says, since a dead letter must not be lost
    or doubled by a producer retry. Records are sent at once (``linger.ms=0``): each one is
    waited for.
    """
    relay = purpose == "relay"
    config: dict[str, Any]
    if relay:
        config = {"bootstrap.servers": bootstrap_servers, "client.id": client_id}
        config.update(DEFAULT_CONFIG)
        config.update({k: str(v) for k, v in overrides.items()})
        if "delivery.timeout.ms" in config:  # librdkafka's alias: one name from here on
            config["message.timeout.ms"] = config.pop("delivery.timeout.ms")
    else:
        config = {k: v for k, v in overrides.items() if not _consumer_only(k)}
        config["bootstrap.servers"] = bootstrap_servers
        config.setdefault("linger.ms", 0)
    for key, value in (RELAY_REQUIRED_CONFIG if relay else REQUIRED_CONFIG).items():
        if relay:
            given = str(config.get(key, value)).lower()
            normalized = {"-1": "all", "1": "true"}.get(given, given) if key == "acks" else given
            if key != "acks" and normalized == "1":
                normalized = "true"
            if normalized != value:
                raise ConfigurationError(
                    f"--kafka-config {key}={config[key]} is not allowed: the relay needs "
                    f"{key}={value} to deliver without loss and in order; remove that setting"
                )
        config[key] = value
    if not relay:
        return config
    timeout = config.get("message.timeout.ms", "1")
    if not timeout.isdigit() or int(timeout) <= 0:
        raise ConfigurationError(
            f"--kafka-config message.timeout.ms={timeout} is not allowed: the relay needs a "
            "positive bound on delivery (0 means wait forever) to back off and retry an outage"
        )
    if config.get("partitioner") == "random":
        raise ConfigurationError(
            "--kafka-config partitioner=random is not allowed: per-key order needs a "
            "partitioner that sends every record of a key to one partition (the default "
            "murmur2_random, or consistent_random, fnv1a_random ...); remove that setting"
        )
    if "transactional.id" in config:
        raise ConfigurationError(
            "--kafka-config transactional.id is not supported by the relay: remove it (the "
            "idempotent producer already gives ordered, de-duplicated retries)"
        )
    return config


def _consumer_only(name: str) -> bool:
    return name in CONSUMER_ONLY or name.startswith(CONSUMER_ONLY_PREFIXES)


def consumer_config(
    bootstrap_servers: str, group: str, overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """The librdkafka configuration of the consumer runner's consumer.

    ``overrides`` (the runner's ``kafka_config``) win over the defaults (``auto.offset.reset``
    ``earliest``); the servers, the group and ``enable.auto.commit=false`` -- the runner commits
    an offset only behind a finished message -- win over ``overrides``.
    """
    config: dict[str, Any] = {"auto.offset.reset": "earliest", "enable.partition.eof": False}
    config.update(overrides)
    config.update(
        {"bootstrap.servers": bootstrap_servers, "group.id": group, "enable.auto.commit": False}
    )
    return config


def refused(exc: BaseException, config: Mapping[str, Any]) -> ConfigurationError:
    """The error for a configuration the Kafka client refused, secrets of ``config`` hidden."""
    return ConfigurationError(
        "the Kafka client refused the configuration: "
        f"{redact(str(exc), kafka_config=config)}; check kafka_config"
    )
