"""``outbox consume``: run a handler on Kafka messages, at most once per idempotency key."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from outbox._core.codec import IDEMPOTENCY_HEADER
from outbox._core.handlers import is_coroutine_handler
from outbox._core.redact import redact_url
from outbox._core.settings import check_handler_reference
from outbox._core.stopping import stop_on_signals
from outbox.cli._common import (
    CONSUMER_METRICS_PORT,
    EXIT_OK,
    FLAGS,
    SECRETS_EPILOG,
    add_flags,
    add_kafka_config,
    integer,
    require,
    resolve_flags,
    tune_collector,
)
from outbox.config import ConsumerConfig, OutboxConfig
from outbox.consumer import AsyncConsumerRunner, ConsumerRunner, serve_metrics
from outbox.errors import ConfigurationError
from outbox.guard import AsyncRedisGuard, RedisGuard
from outbox.uow import AsyncOutbox, Outbox

# What configures the outbox (a unit of work per message) and what configures the Redis guard
# (a claim per message): a command takes one or the other, never a mix.
_OUTBOX_FLAGS = ("database_url", "schema", "redis_url", "pooler")
_GUARD_FLAGS = ("guard_lease", "guard_on_redis_error", "guard_secret")

log = logging.getLogger("outbox.consumer")


def register(subparsers: Any) -> None:
    """Add ``outbox consume`` to the ``outbox`` command."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "consume",
        help="run a handler on Kafka messages, at most once per idempotency key",
        description="Consume TOPICs as consumer group GROUP and run HANDLER (module:function, "
        "called as handler(uow, message)) inside a unit of work keyed by each message's "
        "X-Idempotency-Key header. With --guard-redis-url instead of --database-url, HANDLER "
        "is called as handler(claim, message) under a Redis guard claim of the key (for "
        "effects outside PostgreSQL). An async def HANDLER runs on the asyncio runner. "
        "SIGTERM/SIGINT finish the message in hand, commit and exit 0.",
        epilog=SECRETS_EPILOG,
    )
    p.add_argument("handler", metavar="HANDLER", help="module:function, e.g. app.consumers:handle")
    p.add_argument(
        "--topic", dest="topics", action="append", required=True, metavar="TOPIC",
        help="topic to consume (repeatable)",
    )  # fmt: skip
    add_flags(p, "group")
    p.add_argument(
        "--scope", default=None,
        help="idempotency scope, if it must differ from the group name",
    )  # fmt: skip
    add_flags(p, "database_url", "schema", "redis_url", "pooler", "bootstrap_servers")
    add_flags(p, "guard_redis_url", *_GUARD_FLAGS)
    p.add_argument(
        "--guard-cluster", action="store_true",
        help="the --guard-redis-url names a node of a Redis Cluster",
    )  # fmt: skip
    add_kafka_config(p)
    p.add_argument(
        "--key-header", default=IDEMPOTENCY_HEADER,
        help=f"header that carries the idempotency key (default {IDEMPOTENCY_HEADER})",
    )  # fmt: skip
    p.add_argument(
        "--max-attempts", type=integer, default=5,
        help="attempts before a failing message is dead-lettered (default 5)",
    )  # fmt: skip
    p.add_argument(
        "--dlq-suffix", default=".dlq",
        help="dead-letter topic of TOPIC is TOPIC+suffix (default .dlq)",
    )  # fmt: skip
    p.add_argument(
        "--batch-size", type=int, default=None,
        help="messages per PostgreSQL transaction, each in a savepoint "
        f"(default {ConsumerConfig.batch_size}; 1: a transaction per message; always 1 with "
        "--guard-redis-url)",
    )  # fmt: skip
    p.add_argument(
        "--batch-wait", type=float, default=ConsumerConfig.batch_wait,
        help="seconds a batch that is not full waits for more messages "
        f"(default {ConsumerConfig.batch_wait:g})",
    )  # fmt: skip
    p.add_argument(
        "--savepoint-chunk", type=int, default=ConsumerConfig.savepoint_chunk,
        help="messages of a batch per savepoint: more saves a round trip each, and a failing "
        "message then sends the others of its chunk to the next batch "
        f"(default {ConsumerConfig.savepoint_chunk})",
    )  # fmt: skip
    p.add_argument(
        "--concurrency", type=int, default=ConsumerConfig.concurrency,
        help="messages in flight at once, each in a transaction of its own: a partition's "
        "messages of different Kafka keys run concurrently, those of one key in order "
        f"(default {ConsumerConfig.concurrency})",
    )  # fmt: skip
    p.add_argument(
        "--optimistic", action="store_true",
        help="run a batch's handlers without savepoints, their statements pipelined; a failure "
        "runs the batch again with a savepoint per message (handlers must be safe to run twice)",
    )  # fmt: skip
    add_flags(p, CONSUMER_METRICS_PORT, "metrics_host", "trace_context", "log_level")
    p.set_defaults(func=command)


def config_from_args(args: argparse.Namespace) -> ConsumerConfig:
    """The runner's settings from flags and ``OUTBOX_*`` variables, checked (no I/O)."""
    resolve_flags(args)
    guarded = _check_store(args)
    check_handler_reference(args.handler)
    batch_size = args.batch_size
    if batch_size is None:
        batch_size = 1 if guarded else ConsumerConfig.batch_size
    return ConsumerConfig(
        topics=tuple(args.topics),
        group=require(args, "group"),
        scope=args.scope,
        bootstrap_servers=require(args, "bootstrap_servers"),
        kafka_config=args.kafka_config,
        key_header=args.key_header,
        max_attempts=args.max_attempts,
        dlq_topic_suffix=args.dlq_suffix,
        batch_size=batch_size,
        batch_wait=args.batch_wait,
        savepoint_chunk=args.savepoint_chunk,
        concurrency=args.concurrency,
        optimistic=args.optimistic,
        trace_context=args.trace_context,
    ).validate()


def _check_store(args: argparse.Namespace) -> bool:
    """Refuse a mix of outbox and guard settings; True for a guarded consumer."""
    if not args.guard_redis_url:
        extra = [FLAGS[d] for d in _GUARD_FLAGS if getattr(args, d) is not None]
        if extra or args.guard_cluster:
            shown = ", ".join(f"{f.option} ({f.env})" for f in extra) or "--guard-cluster"
            raise ConfigurationError(
                f"{shown} configures the Redis guard: add --guard-redis-url (or set "
                f"{FLAGS['guard_redis_url'].env}), or drop it"
            )
        require(args, "database_url")
        return False
    mixed = [FLAGS[d] for d in _OUTBOX_FLAGS if getattr(args, d) is not None]
    if mixed:
        shown = ", ".join(f"{f.option} ({f.env})" for f in mixed)
        raise ConfigurationError(
            f"--guard-redis-url runs the handler under the Redis guard, without the outbox: "
            f"drop {shown}, or drop --guard-redis-url to run units of work"
        )
    if args.batch_size not in (None, 1):
        raise ConfigurationError(
            f"--batch-size {args.batch_size} with --guard-redis-url: a guarded consumer handles "
            "one message at a time (micro-batches share a PostgreSQL transaction); drop "
            "--batch-size"
        )
    return True


def _outbox_config(args: argparse.Namespace) -> OutboxConfig:
    return OutboxConfig(schema=args.schema, pooler=args.pooler)


def command(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    # Like `python -m`: handler modules next to where the command runs are importable.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    handler = load_handler(args.handler)
    if is_coroutine_handler(handler):
        asyncio.run(_consume_async(args, handler, config))
        return EXIT_OK
    target: Outbox | RedisGuard
    if args.guard_redis_url:
        target = RedisGuard(args.guard_redis_url, cluster=args.guard_cluster, **_guarding(args))
    else:
        target = Outbox(args.database_url, redis_url=args.redis_url, config=_outbox_config(args))
    try:
        runner = ConsumerRunner(target, handler, config)
        with _serving(runner, args):
            runner.run()
    finally:
        target.close()
    return EXIT_OK


async def _consume_async(
    args: argparse.Namespace,
    handler: Callable[..., Any],
    config: ConsumerConfig,
) -> None:
    if args.guard_redis_url:
        guard = AsyncRedisGuard(args.guard_redis_url, cluster=args.guard_cluster, **_guarding(args))
        try:
            await _run_async(AsyncConsumerRunner(guard, handler, config), args)
        finally:
            await guard.aclose()
        return
    ob = AsyncOutbox(args.database_url, redis_url=args.redis_url, config=_outbox_config(args))
    try:
        await _run_async(AsyncConsumerRunner(ob, handler, config), args)
    finally:
        await ob.close()


async def _run_async(runner: AsyncConsumerRunner, args: argparse.Namespace) -> None:
    with _serving(runner, args):
        await runner.run()


def _guarding(args: argparse.Namespace) -> dict[str, Any]:
    """The guard's settings from the flags (their defaults where left out)."""
    settings: dict[str, Any] = {}
    if args.guard_lease is not None:
        settings["lease"] = args.guard_lease
    if args.guard_secret is not None:
        settings["secret"] = args.guard_secret
    if args.guard_on_redis_error is not None:
        settings["on_redis_error"] = args.guard_on_redis_error
    return settings


@contextmanager
def _serving(
    runner: ConsumerRunner | AsyncConsumerRunner, args: argparse.Namespace
) -> Iterator[None]:
    """Around a runner's run(): the metrics and health endpoints, and SIGTERM/SIGINT to stop."""
    tune_collector()
    server = None
    if args.metrics_port:
        server = serve_metrics(runner, args.metrics_port, host=args.metrics_host)
        log.info("metrics on %s:%d/metrics, health on /healthz", server.host, server.port)
    flavour = "asyncio" if isinstance(runner, AsyncConsumerRunner) else "sync"
    if runner.guard is not None:
        settings = runner.guard.settings
        log.info(
            "guard on redis %s%s (lease %gs, on_redis_error %s), %s runner",
            redact_url(args.guard_redis_url),
            " (cluster)" if args.guard_cluster else "",
            settings.lease,
            settings.on_redis_error,
            flavour,
        )
    else:
        log.info(
            "database %s, redis %s, %s runner",
            redact_url(args.database_url),
            redact_url(args.redis_url) if args.redis_url else "off",
            flavour,
        )
    try:
        with stop_on_signals(runner.stop):
            yield
    finally:
        if server is not None:
            server.close()


def load_handler(ref: str) -> Callable[..., Any]:
    """Import ``module:attribute`` (attribute may be dotted) and check that it is callable."""
    module_name, parts = check_handler_reference(ref)
    attr = ".".join(parts)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(
            f"cannot import handler module {module_name!r}: {exc} (run from the directory that "
            "contains it, or put it on PYTHONPATH)"
        ) from exc
    for part in parts:
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ConfigurationError(f"module {module_name!r} has no attribute {attr!r}") from exc
    if not callable(obj):
        raise ConfigurationError(f"handler {ref!r} is not callable")
    handler: Callable[..., Any] = obj
    return handler
