"""The console's overview shows each consumer group's lag as the broker reports it (a real
console process, real PostgreSQL, the session's broker), and says so when the broker cannot."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable

import httpx
from confluent_kafka import Consumer, Producer, TopicPartition

from tests.fixtures.common import free_port
from tests.fixtures.console import ConsoleServer
from tests.fixtures.kafka import create_topic


def write(bootstrap: str, topic: str, counts: dict[int, int]) -> None:
    """``counts[partition]`` records per partition, each in a batch of its own: Tansu answers
    a ListOffsets request with the last batch's first offset plus one (tests/fixtures/kafka.py),
    which is the end offset only when every batch holds one record."""
    producer = Producer({"bootstrap.servers": bootstrap})
    for partition, count in counts.items():
        for n in range(count):
            producer.produce(topic, value=f"{n}".encode(), partition=partition)
            assert producer.flush(10) == 0


def commit(bootstrap: str, group: str, offsets: dict[tuple[str, int], int]) -> None:
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": group, "session.timeout.ms": 6000}
    )
    try:
        consumer.commit(
            offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()], asynchronous=False
        )
    finally:
        consumer.close()


def lag_row(page: str, group: str, topic: str) -> tuple[int, ...] | None:
    found = re.search(
        rf"<td>{re.escape(group)}</td><td>{re.escape(topic)}</td>"
        r'<td class="num">(\d+)</td><td class="num">(\d+)</td><td class="num">(\d+)</td>'
        r'<td class="num lag">(\d+)</td>',
        page,
    )
    return None if found is None else tuple(int(n) for n in found.groups())


def test_the_overview_shows_a_groups_committed_end_and_lag_per_topic(
    console_server: Callable[..., ConsoleServer], kafka_bootstrap: str
) -> None:
    orders, audit = f"orders-{uuid.uuid4().hex[:8]}", f"audit-{uuid.uuid4().hex[:8]}"
    group = f"billing-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, orders, 2)
    create_topic(kafka_bootstrap, audit, 1)
    write(kafka_bootstrap, orders, {0: 4, 1: 3})
    write(kafka_bootstrap, audit, {0: 2})
    commit(kafka_bootstrap, group, {(orders, 0): 1, (orders, 1): 3, (audit, 0): 2})
    server = console_server("--bootstrap-servers", kafka_bootstrap)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        page = client.get("/")
        assert page.status_code == 200, page.text
        # partitions, committed (1 + 3), end (4 + 3), lag (3 + 0)
        assert lag_row(page.text, group, orders) == (2, 4, 7, 3), page.text
        assert lag_row(page.text, group, audit) == (1, 2, 2, 0)
        # The answer is reused for a few seconds, then read again.
        commit(kafka_bootstrap, group, {(orders, 0): 4})
        assert lag_row(client.get("/").text, group, orders) == (2, 4, 7, 3)
        time.sleep(5.5)
        assert lag_row(client.get("/").text, group, orders) == (2, 7, 7, 0)


def test_a_broker_that_does_not_answer_is_a_message_on_the_page_not_an_error(
    console_server: Callable[..., ConsoleServer],
) -> None:
    server = console_server("--bootstrap-servers", f"127.0.0.1:{free_port()}")
    with httpx.Client(base_url=server.url, timeout=30) as client:
        started = time.monotonic()
        page = client.get("/")
        took = time.monotonic() - started
    assert page.status_code == 200
    assert 'id="lag-unavailable"' in page.text
    assert "listing the consumer groups: the broker did not answer in time" in page.text
    assert took < 8, f"the overview waited {took:.1f} s for a broker that is not there"


def test_without_a_broker_the_section_says_how_to_get_one(
    console_server: Callable[..., ConsoleServer],
) -> None:
    with httpx.Client(base_url=console_server().url) as client:
        page = client.get("/").text
    assert "start the console with --bootstrap-servers to see the consumer groups" in page


def test_a_commit_past_the_end_of_its_partition_is_explained(
    console_server: Callable[..., ConsoleServer], kafka_bootstrap: str
) -> None:
    topic, group = f"orders-{uuid.uuid4().hex[:8]}", f"billing-{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, topic, 1)
    write(kafka_bootstrap, topic, {0: 2})
    # As after the topic was created again, or an in-memory broker restarted: the group's
    # position is past what the log holds.
    commit(kafka_bootstrap, group, {(topic, 0): 9})
    server = console_server("--bootstrap-servers", kafka_bootstrap)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        page = client.get("/").text
    assert re.search(
        rf"<td>{group}</td><td>{topic}</td><td class=\"num\">1</td><td class=\"num\">9 "
        r'<span class="warning ahead">\(1 past the end\)</span></td><td class="num">2</td>',
        page,
    ), page
    assert 'id="lag-ahead"' in page and "the log is shorter than what the group read" in page
