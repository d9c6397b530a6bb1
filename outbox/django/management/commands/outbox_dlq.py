"""``manage.py outbox_dlq``: ``outbox dlq`` with the project's database and settings."""

from __future__ import annotations

import outbox.cli as cli
from outbox.django.management._bridge import Bridge


def _run(args: list[str]) -> int:
    return cli.main(["dlq", *args])


class Command(Bridge):
    help = "outbox dlq with the project's database and settings."
    run_command = staticmethod(_run)
