"""Without opentelemetry importable: everything works, and no opentelemetry module is loaded.
With the API alone (no SDK): nothing is recorded, and an incoming context is passed on.

A subprocess blocks every ``opentelemetry`` import with a meta-path finder (as if the package
were not installed), then publishes, relays and consumes on real services.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import sqlalchemy as sa

from tests.fixtures.kafka import create_topic
from tests.fixtures.relay import REPO

SCRIPT = r"""
import importlib.abc, json, sys, threading, time

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ImportError(f"{name} is blocked")
        return None

sys.meta_path.insert(0, Blocked())
database_url, bootstrap, topic = sys.argv[1:4]

import outbox
from outbox._otel import spans
from outbox.consumer import ConsumerRunner
from outbox.http import asgi, wsgi
from outbox.relay import Relay, RelayConfig

ob = outbox.Outbox(database_url)
given = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
with ob.unit_of_work("off-1") as uow:
    uow.publish(topic, {"n": 1}, key="a")
    uow.publish(topic, {"n": 2}, key="b", headers={"traceparent": given})
assert Relay(RelayConfig(database_url, bootstrap)).run(once=True) == 0

handled = []

def handle(uow, message):
    handled.append({k: v.decode() for k, v in message.headers() or []})
    uow.publish(topic + ".replies", {"seen": message.value().decode()})

runner = ConsumerRunner(
    ob, handle, topics=[topic], group="off", bootstrap_servers=bootstrap,
    kafka_config={"session.timeout.ms": 2000, "heartbeat.interval.ms": 200},
)
thread = threading.Thread(target=runner.run)
thread.start()
deadline = time.monotonic() + 60
while len(handled) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
runner.stop()
thread.join(30)
ob.close()
print(json.dumps({
    "spans": spans is not None,
    "loaded": sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"),
    "handled": handled,
}))
"""


def test_without_opentelemetry_nothing_of_it_loads_and_everything_works(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    topic = f"untraced-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, topic)
    create_topic(kafka_bootstrap, topic + ".dlq")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, database_url, kafka_bootstrap, topic],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["spans"] is False
    assert report["loaded"] == []
    handled = sorted(report["handled"], key=lambda h: h.get("traceparent", ""))
    assert len(handled) == 2
    assert "traceparent" not in handled[0]  # no context made up
    # A context the publisher set travels as given, through the relay, to the handler.
    assert handled[1]["traceparent"] == "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with engine.connect() as conn:
        replies = conn.execute(sa.text("SELECT count(*) FROM outbox WHERE topic LIKE '%.replies'"))
        assert replies.scalar_one() == 2  # the handlers' units of work committed


def test_with_opentelemetry_importable_the_adapter_is_on() -> None:
    probe = "from outbox._otel import spans; print(spans is not None)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "True"


API_ONLY = r"""
import json, sys
from confluent_kafka import Message
import outbox
from outbox._otel import spans
from outbox.http import Headers

database_url, incoming = sys.argv[1:3]
ob = outbox.Outbox(database_url)
# A request that came in with a traceparent (what the HTTP middlewares do with it) ...
with spans.request("POST", "/orders", Headers([("traceparent", incoming)])):
    with ob.unit_of_work("api-1") as uow:
        uow.publish("orders", {"n": 1})
# ... and a consumed record that carries one (the consumer runner's process span).
record = Message(topic="orders", partition=0, offset=7, key=None, value=b"{}",
                 headers=[("traceparent", incoming.encode())])
with spans.process(record, "g", False), ob.unit_of_work("api-2") as uow:
    uow.publish("replies", {"n": 2})
ob.close()
from opentelemetry import trace
print(json.dumps({"provider": type(trace.get_tracer_provider()).__name__}))
"""


def test_with_the_api_alone_an_incoming_context_is_passed_on(
    engine: sa.Engine, database_url: str
) -> None:
    """No SDK: nothing is recorded, but the events carry the context they were published in."""
    incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    out = subprocess.run(
        [sys.executable, "-c", API_ONLY, database_url, incoming],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["provider"] == "ProxyTracerProvider"
    with engine.connect() as conn:
        stored = dict(conn.execute(sa.text("SELECT topic, headers FROM outbox")).all())
    assert stored["orders"]["traceparent"] == incoming
    assert stored["replies"]["traceparent"] == incoming
