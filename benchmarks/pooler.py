"""What the benchmarks that go through a connection pooler share: a private PgBouncer.

``pgbouncer(url, mode, pool_size)`` starts Debian's ``pgbouncer`` on a free loopback port in
front of the server of ``url`` and yields ``url`` rewritten to go through it. PgBouncer refuses
to run as root: as root it runs as ``postgres`` (or ``OUTBOX_BENCH_PGBOUNCER_USER``).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa


@contextlib.contextmanager
def pgbouncer(url: str, mode: str = "transaction", pool_size: int = 20) -> Iterator[str]:
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not os.path.exists(binary):
        raise SystemExit("pgbouncer is not installed (apt-get install pgbouncer)")
    server = sa.make_url(url)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = Path(tempfile.mkdtemp(prefix="outbox-bench-pgbouncer-"))
    user, password = server.username or "postgres", server.password or ""
    (workdir / "users.txt").write_text(f'"{user}" "{password}"\n')
    (workdir / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={server.host or '127.0.0.1'} port={server.port or 5432}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = {'plain' if password else 'trust'}\nauth_file = {workdir / 'users.txt'}\n"
        f"pool_mode = {mode}\ndefault_pool_size = {pool_size}\nmax_client_conn = 1000\n"
        "ignore_startup_parameters = extra_float_digits,options\n"
    )
    argv = [binary]
    if os.geteuid() == 0:
        account = pwd.getpwnam(os.environ.get("OUTBOX_BENCH_PGBOUNCER_USER", "postgres"))
        for path in (workdir, *workdir.iterdir()):
            os.chown(path, account.pw_uid, account.pw_gid)
        argv += ["-u", account.pw_name]
    log = (workdir / "pgbouncer.log").open("ab")
    proc = subprocess.Popen([*argv, str(workdir / "pgbouncer.ini")], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"pgbouncer did not start: {(workdir / 'pgbouncer.log').read_text()}"
                )
            time.sleep(0.05)
        yield server.set(host="127.0.0.1", port=port).render_as_string(hide_password=False)
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)
