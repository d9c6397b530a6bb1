"""The names of :mod:`outbox.testing`, loaded on first use (see its ``__getattr__``)."""

from __future__ import annotations

from sqlalchemy import NullPool, create_engine
from sqlalchemy.ext.asyncio import create_async_engine

from outbox.config import OutboxConfig
from outbox.testing.databases import (
    ENV_TESTING_BOOTSTRAP,
    ENV_TESTING_DATABASE_URL,
    ENV_TESTING_REDIS_URL,
    TemplateDatabases,
    server_url,
)
from outbox.testing.delivery import Deliverer, Delivery, assert_one_effect_per_key, relay_outbox
from outbox.testing.published import Published, PublishedEvent, decode_event
from outbox.uow import AsyncOutbox, Outbox

__all__ = [
    "ENV_TESTING_BOOTSTRAP",
    "ENV_TESTING_DATABASE_URL",
    "ENV_TESTING_REDIS_URL",
    "AsyncOutbox",
    "Deliverer",
    "Delivery",
    "NullPool",
    "Outbox",
    "OutboxConfig",
    "Published",
    "PublishedEvent",
    "TemplateDatabases",
    "assert_one_effect_per_key",
    "create_async_engine",
    "create_engine",
    "decode_event",
    "relay_outbox",
    "server_url",
]
