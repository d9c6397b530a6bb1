"""Asyncio batches under the import path of earlier releases; :mod:`outbox.uow` has them too."""

from __future__ import annotations

from outbox.uow._batch_async import (
    AsyncBatch,
    AsyncMessageBatch,
)

__all__ = [
    "AsyncBatch",
    "AsyncMessageBatch",
]
