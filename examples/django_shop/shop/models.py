from __future__ import annotations

from django.db import models


class Order(models.Model):
    item = models.TextField()
    quantity = models.IntegerField()
    shipped = models.BooleanField(default=False)
