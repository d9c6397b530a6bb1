"""The Django project the door's end-to-end tests serve (``manage.py runserver`` over TCP): its
database, Redis and cache prefix come from the environment the test sets."""

from __future__ import annotations

import os

import sqlalchemy as sa

from tests.django.project.common import (  # noqa: F401  (settings)
    INSTALLED_APPS,
    MIDDLEWARE,
    REST_FRAMEWORK,
    STATIC_URL,
    TEMPLATES,
)

_url = sa.make_url(os.environ["OUTBOX_DATABASE_URL"])

SECRET_KEY = "tests-only"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
USE_TZ = True
ROOT_URLCONF = "tests.django.project.urls"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _url.database,
        "USER": _url.username or "",
        "PASSWORD": _url.password or "",
        "HOST": _url.host or "",
        "PORT": str(_url.port or ""),
    }
}
OUTBOX = {
    "REDIS_URL": os.environ.get("OUTBOX_REDIS_URL"),
    "CACHE_PREFIX": os.environ.get("OUTBOX_TEST_CACHE_PREFIX", "outbox"),
    "KAFKA": {
        "bootstrap.servers": os.environ.get("OUTBOX_TEST_KAFKA_BOOTSTRAP", ""),
        # A consumer group on the test broker joins quickly with a short session.
        **({"session.timeout.ms": "6000"} if os.environ.get("OUTBOX_TEST_CONSUMER") else {}),
    },
}
