"""The toolkit's tables as unmanaged Django models, for the admin pages (:mod:`.admin`).

Invariant: Django never creates, alters or drops these tables (``managed = False``); the
alembic history does (``migrations/0001_initial.py``). The models exist to be read; the admin
changes parked rows only through :mod:`outbox.admin`'s functions.

``idempotency_keys`` and ``outbox_dlq_handled`` have composite primary keys, which Django 4.2's
ORM cannot name: their models declare one column of the key as Django's ``pk`` and the admin
shows them as lists only (no page per row, no delete), where that ``pk`` is never used to find
a row. The tables are those on the connection's ``search_path`` (with ``OUTBOX["SCHEMA"]``, put
that schema on it).
"""

from __future__ import annotations

from django.db import models


class ParkedEvent(models.Model):
    """An outbox row; the admin lists the parked ones (``parked_at`` set)."""

    id = models.BigIntegerField(primary_key=True)
    event_id = models.UUIDField()
    topic = models.TextField()
    key = models.BinaryField(null=True)
    attempts = models.IntegerField()
    last_error = models.TextField(null=True)
    parked_at = models.DateTimeField(null=True)
    created_at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = "outbox"
        verbose_name = "parked event"
        default_permissions = ("view",)
        permissions = [
            ("retry_parked", "Can retry parked outbox rows"),
            ("discard_parked", "Can discard parked outbox rows"),
        ]


class IdempotencyKey(models.Model):
    """A key's stored outcome (``idempotency_keys``); primary key ``(scope, key)``."""

    scope = models.TextField()
    key = models.TextField(primary_key=True)  # why: see the module's docstring
    status = models.TextField()
    fingerprint = models.TextField(null=True)
    result = models.JSONField(null=True)
    error = models.TextField(null=True)
    attempts = models.IntegerField()
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = "idempotency_keys"
        verbose_name = "idempotency key"
        default_permissions = ("view",)


class HandledDeadLetter(models.Model):
    """A dead letter recorded as handled (``outbox_dlq_handled``); primary key ``(dlq_topic,
    partition, offset)``. The dead letters themselves live in Kafka."""

    dlq_topic = models.TextField()
    partition = models.IntegerField()
    offset = models.BigIntegerField(primary_key=True)  # why: see the module's docstring
    handled_at = models.DateTimeField()
    how = models.TextField()
    handled_by = models.TextField(null=True)

    class Meta:
        managed = False
        db_table = "outbox_dlq_handled"
        verbose_name = "handled dead letter"
        default_permissions = ("view",)
