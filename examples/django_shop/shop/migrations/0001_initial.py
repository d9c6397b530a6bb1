from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [
        migrations.CreateModel(
            name="Order",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False)),
                ("item", models.TextField()),
                ("quantity", models.IntegerField()),
                ("shipped", models.BooleanField(default=False)),
            ],
        ),
    ]
