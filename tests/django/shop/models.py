from __future__ import annotations

from django.db import models


class Order(models.Model):
    order_key = models.TextField()
    amount = models.IntegerField()

    class Meta:
        app_label = "shop"
