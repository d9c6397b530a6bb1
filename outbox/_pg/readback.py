# generated from outbox/_pg/readback_async.py by tools/async_to_sync.py; do not edit
"""Generated from ``outbox/_pg/readback_async.py`` by ``tools/async_to_sync.py``."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import psycopg
from sqlalchemy import Engine


class KeyReader:
    """Reads one key's row with ``sql`` (parameters ``scope`` and ``key``) in autocommit."""

    def __init__(self, engine: Engine, sql: str) -> None:
        self._engine = engine
        self._sql = sql
        self._idle: list[psycopg.Connection[Any]] = []
        self._pid = os.getpid()
        self._closed = False

    def read(self, scope: str, key: str) -> tuple[Any, ...] | None:
        """The key's committed row, or ``None``; raises what the driver raises."""
        if self._pid != os.getpid():
            # A forked child: the parent's connections are not its own to use.
            self._idle, self._pid = [], os.getpid()
        idle = self._idle
        driver = idle.pop() if idle else self._connect()
        try:
            cursor = driver.execute(self._sql, {"scope": scope, "key": key})
            row = cursor.fetchone()
        except BaseException:
            with contextlib.suppress(Exception):
                driver.close()
            raise
        if self._closed:
            # Closed while this read ran (an asyncio read-back is a task of its own, which
            # the outbox's close does not wait for): nothing keeps the connection now.
            driver.close()
        else:
            idle.append(driver)
        return None if row is None else tuple(row)

    def _connect(self) -> psycopg.Connection[Any]:
        fairy = self._engine.raw_connection()
        driver = fairy.driver_connection
        fairy.detach()  # the toolkit's own from now on: the pool forgets it
        if not isinstance(driver, psycopg.Connection):
            raise TypeError("outbox-kit needs the psycopg 3 driver (postgresql+psycopg://)")
        driver.set_autocommit(True)
        return driver

    def close(self) -> None:
        """Close the connections kept aside, and from now on each one after its read."""
        self._closed = True
        idle, self._idle = self._idle, []
        if self._pid != os.getpid():
            return
        for driver in idle:
            with contextlib.suppress(Exception):
                driver.close()
