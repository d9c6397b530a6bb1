"""SIGTERM and SIGINT ask a worker to stop, written once for every long-running command.

A worker (relay, consumer runner) exposes ``stop()``; the signal only calls it. The worker then
finishes or rolls back the batch in hand and returns, and the command exits with its code.
Handlers are installed only from the main thread and the previous ones come back on exit.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

log = logging.getLogger("outbox")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def stop_on_signals(stop: Callable[[], None], *, enabled: bool = True) -> Iterator[None]:
    """While the block runs, SIGTERM/SIGINT call ``stop()`` instead of killing the process."""
    enabled = enabled and threading.current_thread() is threading.main_thread()
    previous: dict[int, Any] = {}

    def handle(signum: int, _frame: FrameType | None) -> None:
        log.info("event=stop_requested signal=%s", signal.Signals(signum).name)
        stop()

    if enabled:
        for signum in SIGNALS:
            previous[signum] = signal.signal(signum, handle)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
