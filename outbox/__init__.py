"""outbox-kit: exactly-once effects for Kafka services on PostgreSQL.

``Outbox.unit_of_work(key)`` commits business rows, the idempotency key and outbox events in one
PostgreSQL transaction; duplicates replay the stored result (from Redis when it has it). The
``outbox-relay`` process carries outbox rows to Kafka; ``outbox.consumer`` feeds Kafka messages
back through units of work.
"""

# The release's version, written here only: pyproject.toml reads it (tool.setuptools.dynamic).
__version__ = "0.1.0"

from outbox import _moved
from outbox.config import OutboxConfig
from outbox.errors import (
    ConfigurationError,
    KeyInProgress,
    KeyReuseError,
    OutboxError,
    PermanentError,
    PreviouslyFailed,
    PublishError,
    ReplayedWriteError,
    ValidationError,
)
from outbox.uow import (
    AsyncOutbox,
    AsyncUnitOfWork,
    Outbox,
    UnitOfWork,
    configure,
    default_outbox,
    idempotent,
    unit_of_work,
)

__all__ = [
    "AsyncOutbox",
    "AsyncUnitOfWork",
    "ConfigurationError",
    "KeyInProgress",
    "KeyReuseError",
    "Outbox",
    "OutboxConfig",
    "OutboxError",
    "PermanentError",
    "PreviouslyFailed",
    "PublishError",
    "ReplayedWriteError",
    "UnitOfWork",
    "ValidationError",
    "configure",
    "default_outbox",
    "idempotent",
    "unit_of_work",
]

_moved.install()  # the import paths of earlier releases (outbox/_moved.py)
