"""The thread on which a Kafka client's blocking calls run for asyncio callers.

librdkafka has no asyncio interface: polling, a synchronous commit, waiting for a delivery
report and closing block the calling thread. An asyncio runner hands each such call to the
client's own thread and awaits it, so the event loop keeps serving other tasks meanwhile. One
thread per client keeps the calls in the order they were made, and makes the rebalance
callbacks (which librdkafka runs inside a poll) always run on the same thread.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class ClientThread:
    """Runs a client's blocking calls one after the other on one thread of its own."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the client's thread; the caller's task awaits its result."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Let the thread end once the calls handed to it are done."""
        self._executor.shutdown(wait=False)
