"""Units of work: a handler's writes, its outbox rows and its key's result in one transaction.

Invariant: the names in ``__all__`` are the folder's public face; every module beside this one
is private.
"""

from __future__ import annotations

from outbox.uow._batch import Batch, MessageBatch
from outbox.uow._batch_async import AsyncBatch, AsyncMessageBatch
from outbox.uow._default import configure, default_outbox, idempotent, unit_of_work
from outbox.uow._outbox import Outbox, UnitOfWork
from outbox.uow._outbox_async import AsyncOutbox, AsyncUnitOfWork

__all__ = [
    "AsyncBatch",
    "AsyncMessageBatch",
    "AsyncOutbox",
    "AsyncUnitOfWork",
    "Batch",
    "MessageBatch",
    "Outbox",
    "UnitOfWork",
    "configure",
    "default_outbox",
    "idempotent",
    "unit_of_work",
]
