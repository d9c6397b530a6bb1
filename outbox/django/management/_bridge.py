"""The management commands' bridge to the ``outbox`` commands: the database of the Django alias
and ``settings.OUTBOX`` become the commands' ``OUTBOX_*`` variables, set in this process only
(a password never reaches the command line); every flag of the command is passed through.

``manage.py outbox_relay --once``, ``manage.py outbox_status --json``, ``manage.py outbox_parked
list``, ``manage.py outbox_dlq list``: the flags are those of ``outbox-relay`` and ``outbox
status|parked|dlq`` (``--help`` lists them), and a flag still wins over the settings.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from django.core.management.base import BaseCommand

from outbox._core.environment import (
    ENV_DATABASE_URL,
    ENV_KAFKA_BOOTSTRAP,
    ENV_KAFKA_CONFIG,
    ENV_REDIS_URL,
    ENV_SCHEMA,
)
from outbox.django._settings import alias_of, database_url, outbox_settings
from outbox.errors import ConfigurationError

# What Django's manage.py reads itself before the command runs.
_DJANGO_OPTIONS = ("--settings", "--pythonpath")


def settings_environment(alias: str | None = None) -> dict[str, str]:
    """The ``OUTBOX_*`` variables of the Django project's settings."""
    options = outbox_settings()
    url = database_url(alias_of(alias))
    env = {ENV_DATABASE_URL: url.render_as_string(hide_password=False)}
    if options.get("SCHEMA"):
        env[ENV_SCHEMA] = str(options["SCHEMA"])
    if options.get("REDIS_URL"):
        env[ENV_REDIS_URL] = str(options["REDIS_URL"])
    kafka = dict(options.get("KAFKA") or {})
    if not all(isinstance(k, str) for k in kafka):
        raise ConfigurationError('settings.OUTBOX["KAFKA"] must be a dict of librdkafka settings')
    servers = kafka.pop("bootstrap.servers", None)
    if servers:
        env[ENV_KAFKA_BOOTSTRAP] = str(servers)
    if kafka:
        env[ENV_KAFKA_CONFIG] = "\n".join(f"{k}={v}" for k, v in kafka.items())
    return env


def _passed(argv: Sequence[str]) -> list[str]:
    """The flags after the command's name, without those manage.py itself took."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _DJANGO_OPTIONS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


class Bridge(BaseCommand):
    """A management command that runs an ``outbox`` command with the project's settings."""

    help = "run an outbox command with the Django project's database and settings.OUTBOX"
    run_command: Callable[[list[str]], int]

    def run_from_argv(self, argv: list[str]) -> None:
        # The flags are the outbox command's own: argparse there parses and explains them.
        sys.exit(self.run_outbox(_passed(argv[2:])))

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("outbox_args", nargs="*", help="flags of the outbox command")

    def handle(self, *args: Any, **options: Any) -> None:  # call_command(...)
        code = self.run_outbox([*args, *options.get("outbox_args", [])])
        if code:
            raise SystemExit(code)

    def run_outbox(self, args: list[str]) -> int:
        os.environ.update(settings_environment())
        return type(self).run_command(args)
