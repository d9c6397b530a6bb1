"""Batches under the import path of earlier releases; :mod:`outbox.uow` has them too."""

from __future__ import annotations

from outbox.uow._batch import (
    Batch,
    MessageBatch,
)

__all__ = [
    "Batch",
    "MessageBatch",
]
