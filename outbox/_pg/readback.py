# generated from outbox/_pg/readback_async.py by tools/async_to_sync.py; do not edit
"""Generated from ``outbox/_pg/readback_async.py`` by ``tools/async_to_sync.py``."""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy import Engine


class KeyReader:
    """Reads one key's row with ``sql`` (parameters ``scope`` and ``key``) in autocommit, or
    with ``waking_sql``, which also answers whether a relay waits for work (its last column)."""

    def __init__(self, engine: Engine, sql: str, waking_sql: str) -> None:
        self._engine = engine
        self._sql = {False: sql, True: waking_sql}
        # Another driver (an asyncpg engine) reads through SQLAlchemy, a connection of the
        # engine's pool each time.
        self._direct = engine.dialect.driver == "psycopg"
        self._clause = {
            waking: sa.text(re.sub(r"%\((\w+)\)s", r":\1", text))
            for waking, text in self._sql.items()
        }
        self._idle: list[psycopg.Connection[Any]] = []
        self._pid = os.getpid()
        self._closed = False

    def read(
        self, scope: str, key: str, *, waking: bool = False
    ) -> tuple[tuple[Any, ...] | None, bool]:
        """The key's committed row (or ``None``) and, ``waking``, whether a relay waits for
        work (else ``False``); raises what the driver raises."""
        row = self._read(scope, key, waking)
        if not waking:
            return row, False
        assert row is not None  # the probe's row is always there
        *found, idle = row
        return (None if found[0] is None else tuple(found)), bool(idle)

    def _read(self, scope: str, key: str, waking: bool) -> tuple[Any, ...] | None:
        if not self._direct:
            with self._engine.connect() as conn:
                result = conn.execute(self._clause[waking], {"scope": scope, "key": key})
                found = result.first()
            return None if found is None else tuple(found)
        if self._pid != os.getpid():
            # A forked child: the parent's connections are not its own to use.
            self._idle, self._pid = [], os.getpid()
        idle = self._idle
        driver = idle.pop() if idle else self._connect()
        try:
            cursor = driver.execute(self._sql[waking], {"scope": scope, "key": key})
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
