"""``manage.py outbox_relay``: ``outbox-relay`` with the project's database and Kafka settings."""

from __future__ import annotations

from outbox.cli import relay
from outbox.django.management._bridge import Bridge


def _run(args: list[str]) -> int:
    return relay.main(args)


class Command(Bridge):
    help = "outbox-relay with the project's database and Kafka settings."
    run_command = staticmethod(_run)
