"""The example shop's settings: PostgreSQL, Redis and Kafka from the environment."""

from __future__ import annotations

import os

import sqlalchemy as sa

_db = sa.make_url(os.environ.get("SHOP_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/shop"))

SECRET_KEY = os.environ.get("SHOP_SECRET_KEY", "change-me")
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
USE_TZ = True
ROOT_URLCONF = "shop_project.urls"
INSTALLED_APPS = ["outbox.django", "shop"]
MIDDLEWARE = ["outbox.django.middleware.IdempotencyKeyMiddleware"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.database,
        "USER": _db.username or "",
        "PASSWORD": _db.password or "",
        "HOST": _db.host or "",
        "PORT": str(_db.port or ""),
    }
}
OUTBOX = {
    "REDIS_URL": os.environ.get("SHOP_REDIS_URL"),  # optional: the duplicate fast path
    "KAFKA": {"bootstrap.servers": os.environ.get("SHOP_KAFKA", "127.0.0.1:9092")},
    "HTTP": {"require_key": True},
}
