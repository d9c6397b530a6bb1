"""What a consumer's handler is, read from the callable itself: plain or coroutine, a message at
a time or a whole micro-batch -- for the runners, the CLI and the test helpers alike.
"""

from __future__ import annotations

import inspect

# The attribute outbox.consumer.batch_handler sets on a handler that takes a whole micro-batch.
BATCH_HANDLER = "__outbox_batch_handler__"


def is_coroutine_handler(handler: object) -> bool:
    """True when calling ``handler`` returns a coroutine: a coroutine function (also behind
    ``functools.partial`` or as a bound method) or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004 -- the method, not callable()
    )
