"""Closing the Kafka consumer is bounded: a ``close()`` that librdkafka never returns from is left
behind after the timeout, so a stopping runner stops (:func:`outbox._kafka.consumer.close_within`).

The client here is a stand-in with the two calls ``close_within`` makes; the real client's close
is exercised by every consumer integration test."""

from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import KafkaError, KafkaException

from outbox._kafka.consumer import close_within
from outbox.errors import ConsumerError


class _Client:
    def __init__(self, queued: int = 0, close: threading.Event | None = None) -> None:
        self.queued = queued
        self.polls = 0
        self.closed = False
        self._close = close

    def poll(self, timeout: float) -> object | None:
        self.polls += 1
        if self.queued:
            self.queued -= 1
            return object()
        return None

    def close(self) -> None:
        if self._close is not None:
            self._close.wait()  # what librdkafka does when it waits on a rebalance forever
        self.closed = True


def test_queued_events_are_served_then_the_client_closes() -> None:
    client = _Client(queued=3)
    assert close_within(client, timeout=5.0)
    assert client.closed and client.polls == 4  # three events, then nothing left


def test_a_close_that_never_returns_is_left_behind_after_the_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = threading.Event()
    client = _Client(close=release)
    started = time.monotonic()
    try:
        assert not close_within(client, timeout=0.3)
        assert time.monotonic() - started < 5.0
        assert not client.closed
        assert "event=consumer_close_stuck" in caplog.text
    finally:
        release.set()


def test_a_close_that_fails_is_a_consumer_error() -> None:
    class Failing(_Client):
        def close(self) -> None:
            raise KafkaException(KafkaError(KafkaError._DESTROY))

    with pytest.raises(ConsumerError):
        close_within(Failing(), timeout=5.0)


def test_polls_are_bounded() -> None:
    client = _Client(queued=10**9)
    assert close_within(client, timeout=5.0, polls=50)
    assert client.polls == 50 and client.closed
