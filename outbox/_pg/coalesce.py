"""Pipelined statements sent in bursts: psycopg's pipeline mode, minus a write per statement.

In pipeline mode psycopg sends each statement as soon as it is executed -- a ``send()`` and a
``poll()`` per statement, and a wake-up of the server's backend for each: on a machine whose
cores the server shares, that wake-up, not the statement, is most of what a pipelined
statement costs. :func:`coalesce` makes a pipeline keep executed statements in its queue until
``burst`` of them wait, or until something needs an answer (rows read, a sync, the pipeline's
end): then everything queued goes at once, in order -- put in libpq's output buffer together and
written in one go, where psycopg's own loop would poll the socket and send once per statement.
What the server sees is the same statements in the same order in the same transaction; only the
packets are fewer.

Invariant: a statement whose answer is read is sent first, with everything queued before it --
the queue is drained before any fetch, sync or exit, so nothing waits for an answer to a
statement still held here.

Written against psycopg's pipeline internals (``_communicate_gen``, ``_fetch_gen`` and
``_enqueue_sync`` of ``psycopg._pipeline_base.BasePipeline``, present since psycopg 3.1); where they
are missing, :func:`coalesce` leaves the pipeline as it is. Both flavours use it: the generators are
psycopg's own, waited on by the sync or the asyncio connection.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

_HOOKS = ("_communicate_gen", "_fetch_gen", "_enqueue_sync")

# Statements held before a burst goes: enough that a send serves many messages, few enough that
# the server starts on them while the handlers still run.
BURST = 64


def coalesce(pipeline: Any, burst: int = BURST) -> bool:
    """Hold ``pipeline``'s statements until ``burst`` wait or an answer is needed; False (and
    nothing changed) when this psycopg's pipeline does not have the hooks it needs."""
    cls = type(pipeline)
    if burst < 2 or not all(callable(getattr(cls, name, None)) for name in _HOOKS):
        return False
    queue = pipeline.command_queue
    communicate = cls._communicate_gen.__get__(pipeline)
    fetch = cls._fetch_gen.__get__(pipeline)
    enqueue_sync = cls._enqueue_sync.__get__(pipeline)
    synced = False  # a sync is queued: psycopg waits for its answer next

    def send_all() -> None:
        # Into libpq's output buffer, every one of them: the connection is nonblocking, so a
        # command only buffers, and communicate() then writes them in one go -- left to it, it
        # would wait on the socket once per command.
        while queue:
            queue.popleft()()

    def held() -> Generator[Any, Any, None]:
        nonlocal synced
        if synced or len(queue) >= burst:
            synced = False
            send_all()
            yield from communicate()

    def fetched(*, flush: bool) -> Generator[Any, Any, None]:
        if queue:
            send_all()
            yield from communicate()
        yield from fetch(flush=flush)

    def sync() -> None:
        nonlocal synced
        enqueue_sync()
        synced = True

    pipeline._communicate_gen = held
    pipeline._fetch_gen = fetched
    pipeline._enqueue_sync = sync
    return True
