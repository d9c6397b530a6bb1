"""The asyncio units of work under the import path of earlier releases; :mod:`outbox.uow` has
them too.
"""

from __future__ import annotations

from outbox.uow._outbox_async import (
    AsyncOutbox,
    AsyncUnitOfWork,
)

__all__ = [
    "AsyncOutbox",
    "AsyncUnitOfWork",
]
