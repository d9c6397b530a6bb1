"""Operations on a running pipeline, as functions: status, gc, parked rows, dead letters (and
which of them are handled), lanes.

The ``outbox`` commands and the console print what these return; each reads and changes only
what its name says. Reading the status or the relays' lanes takes no lock a unit of work or a
relay waits for.
"""

from __future__ import annotations

from outbox._core.durations import (
    DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS,
    check_retention,
    format_duration,
    format_ranges,
    parse_duration,
)
from outbox._core.lanes import (
    DEFAULT_LANES,
    MAX_LANES,
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
from outbox.admin._fleet_status import (
    DatabaseStatus,
    fleet_status_to_json,
    fleet_urls,
    identity_of,
    read_database_status,
    read_fleet_status,
    render_fleet_status,
    unhealthy_first,
)
from outbox.admin._gc import (
    DEFAULT_GC_BATCH_SIZE,
    MAX_GC_BATCH_SIZE,
    GcResult,
    check_duty_cycle,
    check_gc_batch_size,
    count_expired_keys,
    delete_expired_keys,
    gc_cutoff,
    gc_to_json,
    run_gc,
)
from outbox.admin._parked import ParkedRow, discard_parked, list_parked, retry_parked
from outbox.admin._status import (
    LaneBacklog,
    PendingCount,
    ScopeKeys,
    Status,
    TopicBacklog,
    choose_lanes,
    count_pending,
    read_status,
    render_status,
    status_to_json,
    status_warnings,
)
from outbox.errors import RetentionError

# The face: the operations, and for the commands and the console the gc and lane limits and the
# status's parts and checks.
__all__ = [
    "DEFAULT_GC_BATCH_SIZE",
    "DEFAULT_LANES",
    "DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS",
    "MAX_GC_BATCH_SIZE",
    "MAX_LANES",
    "REDRIVE_HEADER",
    "DatabaseStatus",
    "DeadLetters",
    "GcResult",
    "Group",
    "LaneBacklog",
    "Letter",
    "LockRow",
    "ParkedRow",
    "PendingCount",
    "RelayInfo",
    "RetentionError",
    "ScopeKeys",
    "Status",
    "TopicBacklog",
    "check_duty_cycle",
    "check_gc_batch_size",
    "check_retention",
    "choose_lanes",
    "count_expired_keys",
    "count_pending",
    "delete_expired_keys",
    "discard",
    "discard_parked",
    "fleet_status_to_json",
    "fleet_urls",
    "format_duration",
    "format_ranges",
    "gc_cutoff",
    "gc_to_json",
    "identity_of",
    "list_parked",
    "mark_handled",
    "ownership_from_locks",
    "parse_duration",
    "read_database_status",
    "read_dead_letters",
    "read_fleet_status",
    "read_groups",
    "read_handled",
    "read_status",
    "redrive",
    "relay_ownership",
    "render_fleet_status",
    "render_status",
    "retry_parked",
    "run_gc",
    "status_to_json",
    "status_warnings",
    "unhealthy_first",
]
