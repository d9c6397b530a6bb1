"""Operations on a running pipeline, as functions: status, gc, parked rows, dead letters (and
which of them are handled), lanes.

The ``outbox`` commands and the console print what these return; each reads and changes only
what its name says. Reading the status or the relays' lanes takes no lock a unit of work or a
relay waits for.
"""

from __future__ import annotations

from outbox._core.durations import (
    DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS as DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS,
    check_retention,
    format_duration,
    format_ranges,
    parse_duration,
)
from outbox._core.lanes import (
    DEFAULT_LANES as DEFAULT_LANES,
    MAX_LANES as MAX_LANES,
    LockRow,
    RelayInfo,
    ownership_from_locks,
)
from outbox._pg.lanes import relay_ownership
from outbox.admin._dlq import (
    REDRIVE_HEADER,
    DeadLetters,
    Group,
    Letter,
    discard,
    mark_handled,
    read_dead_letters,
    read_groups,
    read_handled,
    redrive,
)
from outbox.admin._gc import (
    DEFAULT_GC_BATCH_SIZE as DEFAULT_GC_BATCH_SIZE,
    MAX_GC_BATCH_SIZE as MAX_GC_BATCH_SIZE,
    GcResult,
    check_duty_cycle as check_duty_cycle,
    check_gc_batch_size as check_gc_batch_size,
    count_expired_keys as count_expired_keys,
    delete_expired_keys as delete_expired_keys,
    gc_cutoff as gc_cutoff,
    gc_to_json as gc_to_json,
    run_gc,
)
from outbox.admin._parked import ParkedRow, discard_parked, list_parked, retry_parked
from outbox.admin._status import (
    LaneBacklog as LaneBacklog,
    PendingCount as PendingCount,
    ScopeKeys as ScopeKeys,
    Status,
    TopicBacklog as TopicBacklog,
    choose_lanes as choose_lanes,
    count_pending as count_pending,
    read_status,
    render_status,
    status_to_json,
    status_warnings as status_warnings,
)
from outbox.errors import RetentionError

# Beside __all__, for the commands and the console: the gc and lane limits, the status's parts
# and checks (``name as name`` marks these re-exports).
__all__ = [
    "REDRIVE_HEADER",
    "DeadLetters",
    "GcResult",
    "Group",
    "Letter",
    "LockRow",
    "ParkedRow",
    "RelayInfo",
    "RetentionError",
    "Status",
    "check_retention",
    "discard",
    "discard_parked",
    "format_duration",
    "format_ranges",
    "list_parked",
    "mark_handled",
    "ownership_from_locks",
    "parse_duration",
    "read_dead_letters",
    "read_groups",
    "read_handled",
    "read_status",
    "redrive",
    "relay_ownership",
    "render_status",
    "retry_parked",
    "run_gc",
    "status_to_json",
]
