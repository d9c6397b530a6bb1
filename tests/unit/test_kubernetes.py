"""deploy/kubernetes: valid objects of a current Kubernetes (``kubernetes-validate``, strict),
and wired to what the programs really read: each container's command, flags and ``OUTBOX_*``
variables are checked against the real ``--help`` of the installed console scripts and parsed
by their own parsers, probes point at ``/healthz`` and ``/readyz`` on the metrics port, the
configuration comes from the ConfigMap and Secret, and the grace periods leave room for the
documented stop bounds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

import outbox
from outbox import admin, cli
from outbox._kafka.config import consumer_config, producer_config
from outbox.cli import consume, gc, relay
from outbox.cli._common import resolve_flags
from outbox.config import ConsumerConfig, RelayConfig

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "deploy" / "kubernetes"
KUSTOMIZATION = "kustomization.yaml"
# The Kubernetes release the manifests are validated against: the newest the installed
# kubernetes-validate knows, and never older than this.
OLDEST_CURRENT = (1, 33)
# The seconds a process may take after SIGTERM to close its clients once its work in hand is
# done (a relay: the producer 1 s, the wake-up listener 2 s, the database session; a consumer:
# the offset commit and leaving the group).
CLOSE = 5.0


def _files() -> list[Path]:
    return sorted(p for p in MANIFESTS.glob("*.yaml") if p.name != KUSTOMIZATION)


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for path in _files():
        for doc in yaml.safe_load_all(path.read_text()):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"{key} defined twice"
            out[key] = doc
    return out


def _version() -> str:
    version = kubernetes_validate.latest_version()
    assert tuple(int(p) for p in version.split(".")[:2]) >= OLDEST_CURRENT, version
    return str(version)


@pytest.mark.parametrize("path", _files(), ids=lambda p: p.name)
def test_manifest_is_valid_for_a_current_kubernetes(path: Path) -> None:
    version = _version()
    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validation_is_strict_enough_to_catch_a_misspelt_field(
    objects: dict[tuple[str, str], dict[str, Any]],
) -> None:
    deployment = yaml.safe_load(yaml.safe_dump(objects[("Deployment", "outbox-relay")]))
    spec = deployment["spec"]["template"]["spec"]
    spec["terminationGracePeriodSecond"] = spec.pop("terminationGracePeriodSeconds")
    with pytest.raises(kubernetes_validate.ValidationError, match="terminationGracePeriodSecond"):
        kubernetes_validate.validate(deployment, _version(), strict=True)


def test_kustomization_lists_every_manifest_but_the_secret() -> None:
    doc = yaml.safe_load((MANIFESTS / KUSTOMIZATION).read_text())
    assert sorted(doc["resources"]) == sorted(p.name for p in _files() if p.name != "secret.yaml")


def _pod(obj: dict[str, Any]) -> dict[str, Any]:
    spec = obj["spec"]
    if obj["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    pod: dict[str, Any] = spec["template"]["spec"]
    return pod


def _workloads(objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds = ("Deployment", "Job", "CronJob")
    return {name: obj for (kind, name), obj in objects.items() if kind in kinds}


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    containers = _pod(obj)["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def test_the_expected_workloads_exist(objects: dict[tuple[str, str], dict[str, Any]]) -> None:
    assert set(_workloads(objects)) == {
        "outbox-relay", "outbox-consumer", "outbox-migrate", "outbox-gc",
    }  # fmt: skip
    assert objects[("Deployment", "outbox-relay")]
    assert objects[("PodDisruptionBudget", "outbox-relay")]
    assert objects[("Job", "outbox-migrate")]
    assert objects[("CronJob", "outbox-gc")]


def _settings(objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, dict[str, str]]:
    config = objects[("ConfigMap", "outbox-kit")]["data"]
    secret = objects[("Secret", "outbox-kit")]["stringData"]
    return {"configMapKeyRef": config, "secretKeyRef": secret}


def _environment(container: dict[str, Any], settings: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's variables with the values the ConfigMap and Secret give them."""
    assert "envFrom" not in container, "name each variable (env), so each one is checked"
    env = {}
    for var in container["env"]:
        ((source, ref),) = var["valueFrom"].items()
        assert ref["name"] == "outbox-kit", var["name"]
        assert ref["key"] == var["name"], "a variable reads the key of its own name"
        assert ref["key"] in settings[source], f"{source} outbox-kit has no key {ref['key']}"
        env[var["name"]] = settings[source][ref["key"]]
    return env


def _help(command: list[str]) -> str:
    """The real ``--help`` of an installed console script (one line, spaces collapsed)."""
    script = Path(sys.executable).with_name(command[0])
    assert script.exists(), f"{command[0]} is not a console script of this package"
    done = subprocess.run(
        [str(script), *command[1:], "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return " ".join(done.stdout.split())


def test_commands_flags_and_variables_are_what_the_clis_take(
    objects: dict[tuple[str, str], dict[str, Any]],
) -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    settings = _settings(objects)
    for name, obj in _workloads(objects).items():
        container = _container(obj)
        command = container["command"]
        assert command[0] in scripts, f"{name}: {command[0]} is not a console script"
        text = _help(command)
        for flag in [a.split("=")[0] for a in container.get("args", []) if a.startswith("--")]:
            assert f"{flag} " in text, f"{name}: {' '.join(command)} has no {flag}"
        for var in _environment(container, settings):
            assert re.search(rf"\b{var}\b", text), f"{name}: {' '.join(command)} reads no {var}"


def _with_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name in [n for n in os.environ if n.startswith("OUTBOX_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_each_command_accepts_its_configuration(
    objects: dict[tuple[str, str], dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The programs' own parsers and validation take the manifests' arguments and settings."""
    settings = _settings(objects)
    workloads = _workloads(objects)

    def env_of(name: str) -> list[str]:
        container = _container(workloads[name])
        _with_env(monkeypatch, _environment(container, settings))
        return [*container["command"][1:], *container.get("args", [])]

    argv = env_of("outbox-relay")
    config = relay.config_from_args(relay.build_parser().parse_args(argv))
    assert config.metrics_port == 9400 and config.lanes == 32
    producer_config(config.bootstrap_servers, config.kafka_config)  # refuses unsafe settings

    argv = env_of("outbox-consumer")
    args = cli.build_parser(argv).parse_args(argv)
    runner_config = consume.config_from_args(args)
    assert runner_config.group == settings["configMapKeyRef"]["OUTBOX_CONSUMER_GROUP"]
    consumer_config(
        runner_config.bootstrap_servers, runner_config.group, runner_config.kafka_config
    )
    assert args.metrics_port == 9400 and args.database_url and args.redis_url

    argv = env_of("outbox-migrate")
    args = resolve_flags(cli.build_parser(argv).parse_args(argv))
    assert args.command == "migrate" and args.database_url

    argv = env_of("outbox-gc")
    args = resolve_flags(cli.build_parser(argv).parse_args(argv))
    assert args.command == "gc"
    older_than = gc._duration(args, "older_than", None)
    cache_ttl = gc._duration(args, "cache_ttl", gc.DEFAULT_CACHE_TTL_SECONDS)
    window = gc._duration(
        args, "min_redelivery_window", admin.DEFAULT_MIN_REDELIVERY_WINDOW_SECONDS
    )
    admin.check_retention(older_than, cache_ttl, window)  # raises RetentionError if refused


@pytest.mark.parametrize("name", ["outbox-relay", "outbox-consumer"])
def test_probes_scrape_and_resources(
    objects: dict[tuple[str, str], dict[str, Any]], name: str
) -> None:
    deployment = objects[("Deployment", name)]
    container = _container(deployment)
    settings = _settings(objects)
    env = _environment(container, settings)
    port_var = "OUTBOX_RELAY_METRICS_PORT" if name == "outbox-relay" else (
        "OUTBOX_CONSUMER_METRICS_PORT"
    )  # fmt: skip
    (port,) = container["ports"]
    assert port["name"] == "metrics" and port["containerPort"] == int(env[port_var])
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port["containerPort"])
    assert annotations["prometheus.io/path"] == "/metrics"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # A rolling update starts the new pod and waits for its /readyz before stopping an old one.
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_every_container_requests_resources_and_runs_unprivileged(
    objects: dict[tuple[str, str], dict[str, Any]],
) -> None:
    version = outbox.__version__  # the release's version, written once
    for name, obj in _workloads(objects).items():
        container = _container(obj)
        requests = container["resources"]["requests"]
        assert requests.get("cpu") and requests.get("memory"), name
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
        assert _pod(obj)["securityContext"]["runAsNonRoot"] is True, name
        if name != "outbox-consumer":  # the consumer runs in the user's own image
            assert container["image"] == f"outbox-kit:{version}", name


def test_relay_disruption_budget_keeps_a_relay(
    objects: dict[tuple[str, str], dict[str, Any]],
) -> None:
    budget = objects[("PodDisruptionBudget", "outbox-relay")]["spec"]
    deployment = objects[("Deployment", "outbox-relay")]["spec"]
    labels = deployment["template"]["metadata"]["labels"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()
    assert 1 <= budget["minAvailable"] < deployment["replicas"]


def grace_period(objects: dict[tuple[str, str], dict[str, Any]], name: str) -> int:
    seconds: int = _pod(objects[("Deployment", name)])["terminationGracePeriodSeconds"]
    return seconds


def test_grace_periods_cover_the_documented_stop_bounds(
    objects: dict[tuple[str, str], dict[str, Any]],
) -> None:
    # The relay: the batch in hand gets shutdown_grace for Kafka's reports, then it closes.
    relay_bound = RelayConfig("", "").shutdown_grace + CLOSE
    assert grace_period(objects, "outbox-relay") >= 2 * relay_bound
    # The consumer: the message in hand, whose dead letter may wait dlq_timeout.
    consumer_bound = ConsumerConfig.dlq_timeout + CLOSE
    assert grace_period(objects, "outbox-consumer") >= 1.5 * consumer_bound
