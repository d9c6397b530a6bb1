"""The after-commit wake-up when the database hangs or is gone: harmless to its callers."""

from __future__ import annotations

import socket
import threading

import sqlalchemy as sa

from outbox._pg.wakeup import make_notifier
from tests.fixtures.common import free_port


def test_notifier_never_blocks_or_raises_when_the_database_hangs_or_is_gone() -> None:
    # A "database" that accepts connections and never answers: the background send hangs in
    # its connect, and the callers must not notice.
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)
    hanging = sa.create_engine(
        f"postgresql+psycopg://postgres@127.0.0.1:{hole.getsockname()[1]}/none",
        connect_args={"connect_timeout": 30},
    )
    gone = sa.create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/none")
    try:
        for engine in (hanging, gone):
            notify = make_notifier(engine, None, None)
            caller = threading.Thread(target=lambda n=notify: [n() for _ in range(1000)])
            caller.start()
            caller.join(10)
            assert not caller.is_alive(), "notify() blocked its caller"
            assert notify.sent == 0  # type: ignore[attr-defined]
    finally:
        hole.close()
        hanging.dispose()
        gone.dispose()
