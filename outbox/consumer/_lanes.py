"""Key lanes: the messages of one micro-batch that may run at the same time.

A lane is a partition's messages of one Kafka message key, in offset order: lanes run
concurrently (asyncio tasks in the asyncio runner, threads in the sync one), the messages of a
lane one after the other. Written once for both flavours: the sync twin of the micro-batches
calls :func:`run_lanes` where its asyncio source awaits :func:`run_lanes_async`.

Invariant: at most ``limit`` lanes run at once, so at most ``limit`` messages are in flight;
every lane has ended when the call returns (an exception of one is raised after all ended).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def lanes_of(items: Sequence[T], key: Callable[[T], Hashable]) -> list[list[T]]:
    """``items`` grouped by ``key``, each group in the order of ``items``; the groups in the
    order of their first item."""
    lanes: dict[Hashable, list[T]] = {}
    for item in items:
        lanes.setdefault(key(item), []).append(item)
    return list(lanes.values())


async def run_lanes_async(lanes: Sequence[Callable[[], Awaitable[None]]], limit: int) -> None:
    """Run every lane, at most ``limit`` at once, as asyncio tasks."""
    if limit <= 1 or len(lanes) <= 1:
        for lane in lanes:
            await lane()
        return
    waiting = iter(lanes)

    async def worker() -> None:
        for lane in waiting:  # one iterator shared by the workers: each lane runs once
            await lane()

    ended = await asyncio.gather(
        *(worker() for _ in range(min(limit, len(lanes)))), return_exceptions=True
    )
    for outcome in ended:
        if isinstance(outcome, BaseException):
            raise outcome


def run_lanes(lanes: Sequence[Callable[[], None]], limit: int) -> None:
    """Run every lane, at most ``limit`` at once, each in a thread of a pool."""
    if limit <= 1 or len(lanes) <= 1:
        for lane in lanes:
            lane()
        return
    with ThreadPoolExecutor(min(limit, len(lanes)), thread_name_prefix="outbox-lane") as pool:
        futures = [pool.submit(lane) for lane in lanes]
    for future in futures:
        future.result()
