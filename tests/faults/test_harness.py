"""The test harness's tools for breaking services, on real ones: a private broker behind a proxy
that is cut and stalled, a private Redis that really stops and starts."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
import redis
from confluent_kafka import KafkaError, Producer

from tests.fixtures.common import free_port
from tests.fixtures.kafka import Broker, consume_all, create_topic
from tests.fixtures.proxy import TcpProxy
from tests.fixtures.redis import PrivateRedis


def _send_one(producer: Producer, topic: str, value: bytes) -> KafkaError | None:
    """Produce one record, wait for its delivery report and return its error (None: stored)."""
    outcomes: list[KafkaError | None] = []
    producer.produce(topic, value, on_delivery=lambda err, _msg: outcomes.append(err))
    producer.flush(15)
    assert len(outcomes) == 1, "no delivery report within 15 s"
    return outcomes[0]


def _idempotent_producer(bootstrap: str) -> Producer:
    return Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "message.timeout.ms": 2000,
            "reconnect.backoff.max.ms": 200,
        }
    )


@pytest.mark.slow
def test_private_broker_behind_proxy_is_cut_off_and_restored(
    tansu: Callable[..., Broker], tcp_proxy: Callable[..., TcpProxy]
) -> None:
    advertised = free_port()
    broker = tansu(advertised_port=advertised)
    proxy = tcp_proxy("127.0.0.1", broker.port, listen_port=advertised)
    assert broker.bootstrap == f"127.0.0.1:{advertised}"
    topic = f"proxied-{uuid.uuid4().hex[:8]}"
    create_topic(broker.bootstrap, topic)

    producer = _idempotent_producer(broker.bootstrap)
    assert _send_one(producer, topic, b"before") is None
    assert proxy.accepted >= 1

    proxy.cut()
    err = _send_one(producer, topic, b"during")
    assert err is not None and err.code() == KafkaError._MSG_TIMED_OUT

    proxy.restore()
    # A fresh producer: Tansu fences the old one after its timeout (next test).
    assert _send_one(_idempotent_producer(broker.bootstrap), topic, b"after") is None
    values = [m.value() for m in consume_all(broker.bootstrap, topic, 2, timeout=30)]
    assert values == [b"before", b"after"]

    broker.kill()
    assert not broker.running


@pytest.mark.slow
def test_tansu_fences_an_idempotent_producer_after_a_delivery_timeout(
    tansu: Callable[..., Broker], tcp_proxy: Callable[..., TcpProxy]
) -> None:
    """Pins the broker behaviour documented in tests/fixtures/kafka.py for the relay's sake."""
    advertised = free_port()
    broker = tansu(advertised_port=advertised)
    proxy = tcp_proxy("127.0.0.1", broker.port, listen_port=advertised)
    topic = f"fenced-{uuid.uuid4().hex[:8]}"
    create_topic(broker.bootstrap, topic)
    producer = _idempotent_producer(broker.bootstrap)

    # A stall shorter than message.timeout.ms is survived without an error.
    assert _send_one(producer, topic, b"one") is None
    proxy.stall()
    producer.produce(topic, b"two")
    proxy.restore()
    assert producer.flush(15) == 0

    proxy.cut()
    timed_out = _send_one(producer, topic, b"lost")
    assert timed_out is not None and timed_out.code() == KafkaError._MSG_TIMED_OUT
    proxy.restore()

    fenced = _send_one(producer, topic, b"refused")
    assert fenced is not None and fenced.code() == KafkaError.PRODUCER_FENCED
    assert not fenced.fatal() and not fenced.retriable()
    assert _send_one(_idempotent_producer(broker.bootstrap), topic, b"three") is None
    values = [m.value() for m in consume_all(broker.bootstrap, topic, 3, timeout=30)]
    assert values == [b"one", b"two", b"three"]


def test_private_redis_really_stops_and_starts(
    private_redis: Callable[..., PrivateRedis],
) -> None:
    server = private_redis()
    client = redis.Redis.from_url(server.url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        client.set("k", "v")
        server.shutdown()
        assert not server.running
        with pytest.raises(redis.ConnectionError):
            client.ping()
        server.start()
        assert client.ping() is True
        assert client.get("k") is None  # nothing persisted across the restart
    finally:
        client.close()
