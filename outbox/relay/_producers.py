"""The producers of a fleet's relays: a few shared by all, each lent to one relay at a time.

A relay that serves one database keeps its producer for its lifetime. A fleet process runs a
relay per database, and an idle librdkafka client is not free: its threads wake up on their own
timers, and fifty idle producers cost a process about 0.8 % of a core (measured against the
same fleet with producers that do nothing: 0.95 % against 0.14 % for 50 idle databases). Most
of a fleet's databases are idle most of the time, so its relays borrow a producer from the
pool when they have records to send and give it back when they wait for work.

Lending keeps every rule of one producer per relay: a producer is only ever in one relay's
hands, with nothing in flight when it is given back (each batch waits for every report
before the relay waits for work), and a producer that broke (a fatal error, a purge, a send
whose fate stayed unknown) is thrown away by its relay as before, never given back. Records
of one key come from one database and one relay, which sends a batch only after the one
before it was confirmed, so two producers never hold records of one key at once.

The pool keeps ``keep`` idle producers warm (their brokers connected, their producer ids
drawn) so that a wake-up does not wait for a new one, builds more while more relays send at
once, and closes the ones beyond ``keep`` that stayed idle ``linger`` seconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from outbox._kafka.producer import KafkaProducer

# Idle producers kept warm, and how long more of them may stay idle before they are closed.
KEEP = 2
LINGER = 10.0


class ProducerPool:
    """Producers lent to one relay at a time (see the module)."""

    def __init__(
        self,
        factory: Callable[[], KafkaProducer],
        *,
        keep: int = KEEP,
        linger: float = LINGER,
    ) -> None:
        self._factory = factory
        self.keep = keep
        self.linger = linger
        self._lock = threading.Lock()
        # Idle producers, the most recently given back last, with when they were given back.
        self._idle: list[tuple[KafkaProducer, float]] = []
        self.built = 0  # producers built in all (tests and the benchmark read it)
        self.lent = 0  # producers in a relay's hands now

    def warm(self) -> None:
        """Build producers until ``keep`` are idle."""
        while True:
            with self._lock:
                if len(self._idle) >= self.keep:
                    return
            producer = self._build()
            with self._lock:
                self._idle.append((producer, time.monotonic()))

    def lend(self) -> KafkaProducer:
        """An idle producer (the warmest), or a new one."""
        with self._lock:
            self.lent += 1
            if self._idle:
                return self._idle.pop()[0]
        try:
            return self._build()
        except BaseException:
            with self._lock:
                self.lent -= 1
            raise

    def give_back(self, producer: KafkaProducer) -> None:
        """``producer`` back from a relay that waits for work (closed if it cannot be lent
        again: nothing may be in flight on a lent producer)."""
        with self._lock:
            self.lent -= 1
            if producer.reusable():
                self._idle.append((producer, time.monotonic()))
                return
        producer.close(timeout=0.0)

    def forget(self) -> None:
        """A lent producer its relay threw away."""
        with self._lock:
            self.lent -= 1

    def serve(self) -> None:
        """Serve the idle producers' callbacks (client errors, an outage summary), and close
        those beyond ``keep`` that stayed idle ``linger`` seconds."""
        now = time.monotonic()
        with self._lock:
            for producer, _ in self._idle:
                producer.serve()
            spare = len(self._idle) - self.keep
            # The longest idle are first in the list.
            stale = [p for p, since in self._idle[: max(spare, 0)] if now - since >= self.linger]
            if stale:
                self._idle = self._idle[len(stale) :]
        for producer in stale:
            producer.close(timeout=0.0)

    @property
    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def close(self) -> None:
        """Close the idle producers (at the fleet's shutdown, after its relays stopped)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for producer, _ in idle:
            producer.close(timeout=1.0)

    def _build(self) -> KafkaProducer:
        producer = self._factory()
        with self._lock:
            self.built += 1
        return producer
