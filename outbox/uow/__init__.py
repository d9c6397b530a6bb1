"""Units of work: a handler's writes, its outbox rows and its key's result in one transaction.

:class:`Outbox` (and :class:`AsyncOutbox`) opens a unit of work per idempotency key, in a
transaction of its own or joined to the caller's; :class:`Batch` (and :class:`AsyncBatch`) runs
many keys in one transaction; the default outbox behind ``outbox.unit_of_work`` and the
``@idempotent`` decorator live here too. The modules in this folder are private; each sync
module is generated from its ``_async`` source by ``tools/async_to_sync.py``.
"""

from __future__ import annotations

from outbox.uow._batch import Batch, MessageBatch
from outbox.uow._batch_async import AsyncBatch, AsyncMessageBatch
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
]
