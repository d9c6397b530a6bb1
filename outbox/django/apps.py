"""The Django application of the toolkit: add ``"outbox.django"`` to ``INSTALLED_APPS``."""

from __future__ import annotations

from django.apps import AppConfig

from outbox.django import checks  # noqa: F401  (registers the database check)


class OutboxAppConfig(AppConfig):
    name = "outbox.django"
    label = "outbox"
    verbose_name = "Outbox"
    default_auto_field = "django.db.models.BigAutoField"
