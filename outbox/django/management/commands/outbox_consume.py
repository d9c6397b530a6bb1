"""``manage.py outbox_consume module:handler --topic T --group G``: the consumer runner with
each message's ``handler(uow, message)`` in a Django unit of work (the Django ORM writes in the
transaction that stores the key), the broker from ``settings.OUTBOX["KAFKA"]``.

SIGTERM and SIGINT finish the message in hand, commit the finished offsets and exit 0.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from outbox._core.stopping import stop_on_signals
from outbox.cli.consume import load_handler
from outbox.django._settings import outbox_settings
from outbox.django.consumer import DjangoConsumerRunner
from outbox.errors import ConfigurationError


class Command(BaseCommand):
    help = "consume Kafka messages, each handler(uow, message) at most once per idempotency key"

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("handler", help="module:function, called as handler(uow, message)")
        parser.add_argument("--topic", dest="topics", action="append", required=True)
        parser.add_argument("--group", required=True, help="the Kafka consumer group")
        parser.add_argument("--scope", default=None, help="idempotency scope (default: group)")
        parser.add_argument("--max-attempts", type=int, default=5)
        parser.add_argument("--database", default=None, help="DATABASES alias")

    def handle(self, *args: Any, **options: Any) -> None:
        kafka = dict(outbox_settings().get("KAFKA") or {})
        servers = kafka.pop("bootstrap.servers", None)
        try:
            runner = DjangoConsumerRunner(
                load_handler(options["handler"]),
                using=options["database"],
                topics=tuple(options["topics"]),
                group=options["group"],
                scope=options["scope"],
                max_attempts=options["max_attempts"],
                bootstrap_servers=servers or None,
                kafka_config=kafka,
            )
        except ConfigurationError as exc:
            raise CommandError(str(exc)) from None
        with stop_on_signals(runner.stop):
            runner.run()
