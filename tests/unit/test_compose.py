"""docker-compose.yml and Dockerfile: structure, wiring, and agreement with the CLIs.

No Docker engine runs the file here, so every relation a typo could break is checked: images
pinned, health checks and start order, Kafka's KRaft listener settings, and that the
environment given to ``outbox migrate`` and ``outbox-relay`` is what their parsers read.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from outbox import cli
from outbox.cli import relay
from outbox.cli._common import resolve_flags
from outbox.config import (
    ENV_DATABASE_URL,
    ENV_KAFKA_BOOTSTRAP,
    ENV_KAFKA_CONFIG,
    ENV_LOG_LEVEL,
    ENV_METRICS_HOST,
    ENV_REDIS_URL,
    ENV_RELAY_BATCH_SIZE,
    ENV_RELAY_LANES,
    ENV_RELAY_MAX_ATTEMPTS,
    ENV_RELAY_METRICS_PORT,
    ENV_RELAY_POLL_INTERVAL,
    ENV_RELAY_REBALANCE_INTERVAL,
    ENV_SCHEMA,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert isinstance(data, dict)
    return data


def _services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    services = compose["services"]
    assert isinstance(services, dict)
    return services


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    assert isinstance(env, dict), "use the mapping form of environment"
    return {k: str(v) for k, v in env.items()}


def _listeners(value: str) -> dict[str, tuple[str, int]]:
    out = {}
    for item in value.split(","):
        m = re.fullmatch(r"([A-Z_]+)://([^:]*):(\d+)", item.strip())
        assert m, f"listener {item!r} is not NAME://host:port"
        out[m.group(1)] = (m.group(2), int(m.group(3)))
    return out


def _published(service: dict[str, Any]) -> dict[int, int]:
    """container port -> host port."""
    out = {}
    for spec in service.get("ports", []):
        parts = str(spec).split(":")
        out[int(parts[-1])] = int(parts[-2])
    return out


def test_services_and_pinned_images(compose: dict[str, Any]) -> None:
    services = _services(compose)
    assert set(services) == {"postgres", "redis", "kafka", "migrate", "relay"}
    assert services["postgres"]["image"].startswith("postgres:16")
    assert services["redis"]["image"].startswith("redis:7")
    assert re.fullmatch(r"apache/kafka:\d+\.\d+\.\d+", services["kafka"]["image"])
    for name in ("migrate", "relay"):
        assert services[name]["build"] == "."
        assert services[name]["image"] == services["migrate"]["image"]
    assert (REPO / "Dockerfile").is_file()


def test_every_long_running_service_has_a_healthcheck(compose: dict[str, Any]) -> None:
    services = _services(compose)
    for name in ("postgres", "redis", "kafka", "relay"):
        check = services[name].get("healthcheck")
        assert check and check.get("test"), f"{name} has no healthcheck"
        assert check["test"][0] in ("CMD", "CMD-SHELL")
        assert int(check.get("retries", 0)) >= 3
    assert "pg_isready" in services["postgres"]["healthcheck"]["test"]
    assert "ping" in services["redis"]["healthcheck"]["test"]
    kafka_check = " ".join(services["kafka"]["healthcheck"]["test"])
    assert "/opt/kafka/bin/kafka-broker-api-versions.sh" in kafka_check


def test_start_order(compose: dict[str, Any]) -> None:
    services = _services(compose)
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert services["migrate"]["restart"] == "no"
    assert services["relay"]["depends_on"] == {
        "postgres": {"condition": "service_healthy"},
        "kafka": {"condition": "service_healthy"},
        "migrate": {"condition": "service_completed_successfully"},
    }


def test_kafka_is_a_consistent_single_kraft_node(compose: dict[str, Any]) -> None:
    kafka = _services(compose)["kafka"]
    env = _env(kafka)
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    node = env["KAFKA_NODE_ID"]
    listeners = _listeners(env["KAFKA_LISTENERS"])
    advertised = _listeners(env["KAFKA_ADVERTISED_LISTENERS"])
    protocols = dict(p.split(":") for p in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    controller = env["KAFKA_CONTROLLER_LISTENER_NAMES"]

    assert set(listeners) <= set(protocols) and set(advertised) <= set(protocols)
    assert controller in listeners and controller not in advertised
    assert set(advertised) == set(listeners) - {controller}
    for name, (_host, port) in advertised.items():
        assert listeners[name][1] == port, f"{name} advertises another port than it listens on"
    assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] in advertised
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == (
        f"{node}@{kafka['hostname']}:{listeners[controller][1]}"
    )
    for key in (
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR",
    ):
        assert env[key] == "1", f"{key} must be 1 on a single broker"
    assert env["CLUSTER_ID"]

    # One listener for the host (published on the same port), one for the compose network.
    published = _published(kafka)
    host_side = [n for n, (h, _p) in advertised.items() if h == "localhost"]
    inside = [n for n, (h, _p) in advertised.items() if h == kafka["hostname"]]
    assert len(host_side) == 1 and len(inside) == 1
    host_port = advertised[host_side[0]][1]
    assert published == {host_port: host_port}
    assert f"localhost:{inside and advertised[inside[0]][1]}" in " ".join(
        kafka["healthcheck"]["test"]
    )


def _with_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_relay_environment_is_what_outbox_relay_reads(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    services = _services(compose)
    relay_service = services["relay"]
    env = _env(relay_service)
    known = {
        ENV_DATABASE_URL, ENV_KAFKA_BOOTSTRAP, ENV_SCHEMA, ENV_RELAY_BATCH_SIZE,
        ENV_RELAY_POLL_INTERVAL, ENV_RELAY_LANES, ENV_RELAY_MAX_ATTEMPTS,
        ENV_RELAY_REBALANCE_INTERVAL, ENV_RELAY_METRICS_PORT, ENV_KAFKA_CONFIG, ENV_LOG_LEVEL,
        ENV_METRICS_HOST,
    }  # fmt: skip
    assert set(env) <= known, f"unknown variables: {set(env) - known}"
    assert relay_service["command"] == ["outbox-relay"]

    _with_env(monkeypatch, env)
    args = relay.build_parser().parse_args([])
    config = relay.config_from_args(args)
    assert config.database_url == env[ENV_DATABASE_URL]
    assert config.bootstrap_servers == env[ENV_KAFKA_BOOTSTRAP]
    assert config.lanes == int(env[ENV_RELAY_LANES])
    assert config.metrics_port == int(env[ENV_RELAY_METRICS_PORT])
    # Published from the container: the relay must listen beyond its own loopback interface.
    assert config.metrics_host == "0.0.0.0"

    # The URL names the postgres service with its credentials and database.
    pg = _env(services["postgres"])
    url = urlsplit(config.database_url)
    assert url.scheme == "postgresql+psycopg"
    assert (url.hostname, url.port) == ("postgres", 5432)
    assert (url.username, url.password) == (pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"])
    assert url.path == "/" + pg["POSTGRES_DB"]

    # The bootstrap is the broker's in-network advertised listener.
    kafka_env = _env(services["kafka"])
    advertised = _listeners(kafka_env["KAFKA_ADVERTISED_LISTENERS"])
    assert config.bootstrap_servers in {f"{h}:{p}" for h, p in advertised.values()}
    assert config.bootstrap_servers.split(":")[0] == services["kafka"]["hostname"]

    # The health check asks the relay's own metrics port, which is published.
    check = " ".join(relay_service["healthcheck"]["test"])
    assert f"127.0.0.1:{config.metrics_port}/healthz" in check
    assert _published(relay_service) == {config.metrics_port: config.metrics_port}


def test_migrate_environment_is_what_outbox_migrate_reads(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    services = _services(compose)
    migrate = services["migrate"]
    env = _env(migrate)
    assert env[ENV_DATABASE_URL] == _env(services["relay"])[ENV_DATABASE_URL]
    _with_env(monkeypatch, env)
    command = migrate["command"]
    assert command[0] == "outbox"
    args = resolve_flags(cli.build_parser(command[1:]).parse_args(command[1:]))
    assert args.command == "migrate" and args.database_url == env[ENV_DATABASE_URL]


def test_published_ports_match_the_documented_host_urls(compose: dict[str, Any]) -> None:
    services = _services(compose)
    assert _published(services["postgres"]) == {5432: 5432}
    assert _published(services["redis"]) == {6379: 6379}
    header = (REPO / "docker-compose.yml").read_text().split("services:")[0]
    pg = _env(services["postgres"])
    user, password, db = pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"], pg["POSTGRES_DB"]
    assert (
        f"{ENV_DATABASE_URL}=postgresql+psycopg://{user}:{password}@localhost:5432/{db}" in header
    )
    assert f"{ENV_REDIS_URL}=redis://localhost:6379/0" in header
    assert f"{ENV_KAFKA_BOOTSTRAP}=localhost:9092" in header
    ops = (REPO / "docs" / "operations.md").read_text()
    assert f"postgresql+psycopg://{user}:{password}@localhost:5432/{db}" in ops


def test_dockerfile_installs_the_package_and_runs_the_relay() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.1[1-9]", text, re.M)
    for path in ("pyproject.toml", "outbox", "migrations"):
        assert re.search(rf"^COPY .*\b{re.escape(path)}\b", text, re.M), path
    assert re.search(r"^RUN pip install \.", text, re.M)
    assert re.search(r"^USER (?!root)\w+", text, re.M)
    cmd = re.search(r"^CMD (\[.*\])", text, re.M)
    assert cmd is not None and yaml.safe_load(cmd.group(1)) == ["outbox-relay"]
    scripts = (REPO / "pyproject.toml").read_text()
    assert 'outbox-relay = "outbox.cli.relay:main"' in scripts
    assert 'outbox = "outbox.cli:main"' in scripts
    # Everything COPY names must exist, or the build fails.
    for line in text.splitlines():
        if line.startswith("COPY "):
            for src in shlex.split(line)[1:-1]:
                assert (REPO / src).exists(), f"Dockerfile copies missing {src}"
