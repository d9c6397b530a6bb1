"""``outbox console`` while its database is cut off (a real console process behind a loopback
TCP proxy to the real PostgreSQL): every page is a 503, and the log says so once, with no
traceback per request or per sample, then once more when the database is back."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import sqlalchemy as sa

from tests.fixtures.common import wait_for
from tests.fixtures.console import ConsoleServer
from tests.fixtures.proxy import TcpProxy


def test_an_unreachable_database_is_one_log_line_not_a_traceback_per_request(
    database_url: str, tcp_proxy: Callable[..., TcpProxy]
) -> None:
    target = sa.make_url(database_url)
    proxy = tcp_proxy(target.host or "127.0.0.1", target.port or 5432)
    server = ConsoleServer(target.set(port=proxy.port).render_as_string(hide_password=False))
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert client.get("/").status_code == 200
            proxy.cut()
            for _ in range(12):
                assert client.get("/").status_code == 503
                assert client.get("/parked").status_code == 503
            log = server.log()
            assert "Traceback" not in log, log
            down = [line for line in log.splitlines() if "PostgreSQL unreachable" in line]
            assert len(down) == 1, log
            proxy.restore()
            assert client.get("/").status_code == 200
            # The sampler (every 10 s) notices the database answers again.
            wait_for(lambda: "PostgreSQL reachable again" in server.log(), 30, server.log())
        assert "Traceback" not in server.log()
    finally:
        server.stop()
        server.close()
