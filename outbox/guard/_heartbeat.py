"""Call a function at a fixed interval while a block of code runs: a thread, or an asyncio task.

The guard renews a claim's lease with it. The beat itself (the I/O) is the caller's; these
classes only schedule it, so the sync and asyncio guards share everything else.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable


class Heartbeat:
    """Calls ``beat()`` every ``interval`` seconds on a daemon thread, from :meth:`start`
    until :meth:`stop` or until ``beat()`` returns False. ``beat`` must not raise."""

    def __init__(self, interval: float, beat: Callable[[], bool], name: str) -> None:
        self._interval = interval
        self._beat = beat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            if not self._beat():
                return

    def stop(self) -> None:
        """Stop beating; returns once no beat runs any more."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join()


class AsyncHeartbeat:
    """The asyncio twin of :class:`Heartbeat`: a task on the running loop. A body that blocks
    the loop blocks the beats too."""

    def __init__(self, interval: float, beat: Callable[[], Awaitable[bool]], name: str) -> None:
        self._interval = interval
        self._beat = beat
        self._name = name
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            if not await self._beat():
                return

    async def stop(self) -> None:
        """Cancel the task and wait for it; a cancellation of the caller still propagates."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.wait([task])
        if not task.cancelled():
            task.exception()  # retrieved, so asyncio does not log it as never retrieved
