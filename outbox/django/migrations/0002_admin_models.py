"""The admin pages' models over the toolkit's tables (``managed = False``): Django records
them and their permissions, and creates no table (alembic owns them, ``0001_initial``)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("outbox", "0001_initial"),
    ]

    operations = [
        migrations.CreateModel(
            name="HandledDeadLetter",
            fields=[
                ("dlq_topic", models.TextField()),
                ("partition", models.IntegerField()),
                ("offset", models.BigIntegerField(primary_key=True, serialize=False)),
                ("handled_at", models.DateTimeField()),
                ("how", models.TextField()),
                ("handled_by", models.TextField(null=True)),
            ],
            options={
                "verbose_name": "handled dead letter",
                "db_table": "outbox_dlq_handled",
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
        migrations.CreateModel(
            name="IdempotencyKey",
            fields=[
                ("scope", models.TextField()),
                ("key", models.TextField(primary_key=True, serialize=False)),
                ("status", models.TextField()),
                ("fingerprint", models.TextField(null=True)),
                ("result", models.JSONField(null=True)),
                ("error", models.TextField(null=True)),
                ("attempts", models.IntegerField()),
                ("created_at", models.DateTimeField()),
                ("updated_at", models.DateTimeField()),
            ],
            options={
                "verbose_name": "idempotency key",
                "db_table": "idempotency_keys",
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
        migrations.CreateModel(
            name="ParkedEvent",
            fields=[
                ("id", models.BigIntegerField(primary_key=True, serialize=False)),
                ("event_id", models.UUIDField()),
                ("topic", models.TextField()),
                ("key", models.BinaryField(null=True)),
                ("attempts", models.IntegerField()),
                ("last_error", models.TextField(null=True)),
                ("parked_at", models.DateTimeField(null=True)),
                ("created_at", models.DateTimeField()),
            ],
            options={
                "verbose_name": "parked event",
                "db_table": "outbox",
                "permissions": [
                    ("retry_parked", "Can retry parked outbox rows"),
                    ("discard_parked", "Can discard parked outbox rows"),
                ],
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
    ]
