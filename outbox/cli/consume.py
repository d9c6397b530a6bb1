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
from outbox._core.redact import redact_url
from outbox._core.settings import check_handler_reference
from outbox._core.stopping import stop_on_signals
from outbox.cli._common import (
    CONSUMER_METRICS_PORT,
    EXIT_OK,
    add_flags,
    add_kafka_config,
    integer,
    require,
    resolve_flags,
)
from outbox.config import ConsumerConfig
from outbox.consumer import AsyncConsumerRunner, ConsumerRunner, serve_metrics
from outbox.consumer_async import is_coroutine_handler
from outbox.errors import ConfigurationError
from outbox.uow import Outbox
from outbox.uow_async import AsyncOutbox

log = logging.getLogger("outbox.consumer")


def register(subparsers: Any) -> None:
    """Add ``outbox consume`` to the ``outbox`` command."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "consume",
        help="run a handler on Kafka messages, at most once per idempotency key",
        description="Consume TOPICs as consumer group GROUP and run HANDLER (module:function, "
        "called as handler(uow, message)) inside a unit of work keyed by each message's "
        "X-Idempotency-Key header. An async def HANDLER runs on the asyncio runner. "
        "SIGTERM/SIGINT finish the message in hand, commit and exit 0.",
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
    add_flags(p, "database_url", "schema", "redis_url", "bootstrap_servers")
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
        "--batch-size", type=int, default=ConsumerConfig.batch_size,
        help="messages per PostgreSQL transaction, each in a savepoint "
        f"(default {ConsumerConfig.batch_size}; 1: a transaction per message)",
    )  # fmt: skip
    p.add_argument(
        "--batch-wait", type=float, default=ConsumerConfig.batch_wait,
        help="seconds a batch that is not full waits for more messages "
        f"(default {ConsumerConfig.batch_wait:g})",
    )  # fmt: skip
    add_flags(p, CONSUMER_METRICS_PORT, "log_level")
    p.set_defaults(func=command)


def config_from_args(args: argparse.Namespace) -> ConsumerConfig:
    """The runner's settings from flags and ``OUTBOX_*`` variables, checked (no I/O)."""
    resolve_flags(args)
    require(args, "database_url")
    check_handler_reference(args.handler)
    return ConsumerConfig(
        topics=tuple(args.topics),
        group=require(args, "group"),
        scope=args.scope,
        bootstrap_servers=require(args, "bootstrap_servers"),
        kafka_config=args.kafka_config,
        key_header=args.key_header,
        max_attempts=args.max_attempts,
        dlq_topic_suffix=args.dlq_suffix,
        batch_size=args.batch_size,
        batch_wait=args.batch_wait,
    ).validate()


def command(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    database_url = require(args, "database_url")
    # Like `python -m`: handler modules next to where the command runs are importable.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    handler = load_handler(args.handler)
    if is_coroutine_handler(handler):
        asyncio.run(_consume_async(args, database_url, handler, config))
        return EXIT_OK
    ob = Outbox(database_url, redis_url=args.redis_url, schema=args.schema)
    try:
        runner = ConsumerRunner(ob, handler, config)
        with _serving(runner, args, database_url):
            runner.run()
    finally:
        ob.close()
    return EXIT_OK


async def _consume_async(
    args: argparse.Namespace,
    database_url: str,
    handler: Callable[..., Any],
    config: ConsumerConfig,
) -> None:
    ob = AsyncOutbox(database_url, redis_url=args.redis_url, schema=args.schema)
    try:
        runner = AsyncConsumerRunner(ob, handler, config)
        with _serving(runner, args, database_url):
            await runner.run()
    finally:
        await ob.close()


@contextmanager
def _serving(
    runner: ConsumerRunner | AsyncConsumerRunner, args: argparse.Namespace, database_url: str
) -> Iterator[None]:
    """Around a runner's run(): the metrics and health endpoints, and SIGTERM/SIGINT to stop."""
    server = None
    if args.metrics_port:
        server = serve_metrics(runner, args.metrics_port)
        log.info("metrics on :%d/metrics, health on :%d/healthz", server.port, server.port)
    log.info(
        "database %s, redis %s, %s runner",
        redact_url(database_url),
        redact_url(args.redis_url) if args.redis_url else "off",
        "asyncio" if isinstance(runner, AsyncConsumerRunner) else "sync",
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
