"""The dashboard and the alert rules name only metrics that a real relay and a real consumer
export: both are started here (``outbox-relay`` and ``outbox consume`` subprocesses, events
flowing from one to the other) and their ``/metrics`` pages read. The reverse -- exported
metrics that neither the dashboard nor the rules show -- fails too, and is listed in the closing
summary."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.common import REPORTS, free_port, wait_for
from tests.fixtures.kafka import create_topic
from tests.fixtures.processes import die_with_parent, log_tail, stop_process
from tests.fixtures.relay import insert_rows, start_relay

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "outbox-kit.json"
RULES = REPO / "deploy" / "prometheus" / "outbox-kit-rules.yml"
OUTBOX_BIN = str(Path(sys.executable).with_name("outbox"))

# A metric name in PromQL: outbox_ and on, not followed by more name characters.
NAME = re.compile(r"\boutbox_[a-z0-9_]+\b")
# The sample names of a family, by its type (prometheus_client's text format).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


def handle(uow: Any, message: Any) -> None:
    """The consumer's handler (loaded by the subprocess): a unit of work that only reads."""
    uow.connection.execute(sa.text("SELECT 1"))


def dashboard_expressions() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    for var in doc["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def rule_expressions() -> list[str]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule["expr"] for group in doc["groups"] for rule in group["rules"]]


def exported(text: str) -> dict[str, set[str]]:
    """The families of a ``/metrics`` page and their sample names; a labelled family with no
    series yet counts with every sample name its type gives it."""
    families: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue  # the text parser's view of a counter's or histogram's creation time
        names = {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
        families[family.name] = names | {sample.name for sample in family.samples}
    return families


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def test_every_metric_the_dashboard_and_rules_use_is_exported(
    database_url: str, engine: sa.Engine, kafka_bootstrap: str, tmp_path: Path
) -> None:
    topic = f"deploy-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, topic, partitions=2)
    relay_port, consumer_port, fleet_port = free_port(), free_port(), free_port()
    relay_log, consumer_log = tmp_path / "relay.log", tmp_path / "consumer.log"
    fleet_log, databases = tmp_path / "fleet.log", tmp_path / "databases"
    relay = start_relay(
        database_url, kafka_bootstrap, "--metrics-port", str(relay_port), log_path=relay_log
    )
    # A fleet member (over a databases file) serves the same database: the fleet's own series,
    # which a relay of one database has not.
    databases.write_text(database_url + "\n")
    fleet = start_relay(
        database_url, kafka_bootstrap, "--databases-file", str(databases),
        "--metrics-port", str(fleet_port), log_path=fleet_log,
    )  # fmt: skip
    with consumer_log.open("wb") as log:
        consumer = subprocess.Popen(
            [OUTBOX_BIN, "consume", "tests.e2e.test_deploy_metrics:handle", "--topic", topic,
             "--group", f"g-{uuid.uuid4().hex[:8]}", "--database-url", database_url,
             "--bootstrap-servers", kafka_bootstrap, "--kafka-config", "session.timeout.ms=2000",
             "--kafka-config", "heartbeat.interval.ms=200", "--metrics-port", str(consumer_port)],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent(),
        )  # fmt: skip
    try:
        insert_rows(engine, topic, [(f"k{i % 5}", b"{}") for i in range(20)])

        def processed() -> bool:
            line = next(
                (ln for ln in scrape(consumer_port).splitlines()
                 if ln.startswith("outbox_consumer_processed_total{")),
                "",
            )  # fmt: skip
            return line.endswith(" 20.0")

        wait_for(processed, 90, "the consumer never processed the 20 events the relay sent")
        wait_for(
            lambda: "outbox_fleet_database_served{" in scrape(fleet_port),
            60,
            "the fleet member never listed the database it knows",
        )
        families = {
            **exported(scrape(fleet_port)),
            **exported(scrape(relay_port)),
            **exported(scrape(consumer_port)),
        }
    except BaseException:
        print(log_tail(relay_log), log_tail(fleet_log), log_tail(consumer_log), sep="\n---\n")
        raise
    finally:
        for proc in (relay, fleet, consumer):
            stop_process(proc, 15)

    samples = {name for names in families.values() for name in names}
    used = {
        "dashboard": {n for e in dashboard_expressions() for n in NAME.findall(e)},
        "alert rules": {n for e in rule_expressions() for n in NAME.findall(e)},
    }
    for where, names in used.items():
        assert names, f"the {where} name no outbox metric: the pattern is broken"
        unknown = sorted(names - samples)
        assert not unknown, f"the {where} use metrics nobody exports: {unknown}"

    shown = used["dashboard"] | used["alert rules"]
    unshown = sorted(
        f for f, names in families.items() if f.startswith("outbox_") and not names & shown
    )
    REPORTS["exported metrics neither the dashboard nor the alert rules show"] = unshown or [
        "(none)"
    ]
    assert not unshown, (
        f"exported metrics neither the dashboard nor the alert rules show: {unshown}"
    )
