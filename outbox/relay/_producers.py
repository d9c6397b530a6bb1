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
drawn) so that a wake-up does not wait for a new one: whenever a relay borrows one, its own
thread builds the next ahead. While more relays send at once than it has idle, a relay builds
one for itself (its first record then waits for the new producer's id); the ones beyond
``keep`` that stayed idle ``linger`` seconds are closed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from outbox._core.redact import one_line
from outbox._kafka.producer import KafkaProducer

# Idle producers kept warm, and how long more of them may stay idle before they are closed.
KEEP = 4
LINGER = 60.0

log = logging.getLogger("outbox.relay")


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
        # Idle producers, the most recently given back last, with when they were given back
        # (or built); the longest idle first.
        self._idle: list[tuple[KafkaProducer, float]] = []
        self.built = 0  # producers built in all (tests and the benchmark read it)
        self.lent = 0  # producers in a relay's hands now
        # The builder thread keeps ``keep`` producers idle ahead of need: a new producer's
        # first record waits for its producer id (0.5-0.9 s against a local broker, measured,
        # against about 1 ms once it has one), which must not fall on a relay's send.
        self._building = 0
        self._closed = False
        self._wanted = threading.Event()
        self._builder: threading.Thread | None = None

    def warm(self) -> None:
        """Start building producers until ``keep`` are idle (on the pool's own thread)."""
        with self._lock:
            self._refill()

    def lend(self) -> KafkaProducer:
        """An idle producer (the one given back last), or a new one if none is idle; the
        pool then builds another ahead."""
        with self._lock:
            self.lent += 1
            producer = self._idle.pop()[0] if self._idle else None
            self._refill()
        if producer is not None:
            return producer
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
            self._refill()

    def serve(self) -> None:
        """Serve the idle producers' callbacks (client errors, an outage summary), and close
        those beyond ``keep`` that stayed idle ``linger`` seconds."""
        now = time.monotonic()
        with self._lock:
            for producer, _ in self._idle:
                producer.serve()
            spare = len(self._idle) - self.keep
            # The longest idle first (those built ahead are at the front too, but new).
            stale: list[KafkaProducer] = []
            kept: list[tuple[KafkaProducer, float]] = []
            for producer, since in self._idle:
                if len(stale) < spare and now - since >= self.linger:
                    stale.append(producer)
                else:
                    kept.append((producer, since))
            self._idle = kept
        for producer in stale:
            producer.close(timeout=0.0)

    @property
    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def close(self) -> None:
        """Close the idle producers (at the fleet's shutdown, after its relays stopped)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            builder = self._builder
        self._wanted.set()
        if builder is not None:
            builder.join(5.0)
        for producer, _ in idle:
            producer.close(timeout=1.0)

    def _refill(self) -> None:
        # Under self._lock.
        if self._closed or len(self._idle) + self._building >= self.keep:
            return
        self._wanted.set()
        if self._builder is None:
            self._builder = threading.Thread(
                target=self._build_ahead, name="outbox-relay-producers", daemon=True
            )
            self._builder.start()

    def _build_ahead(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            while True:
                with self._lock:
                    if self._closed:
                        return
                    if len(self._idle) + self._building >= self.keep:
                        break
                    self._building += 1
                try:
                    producer = self._build()
                except Exception as exc:  # a relay builds its own when it needs one
                    log.warning("event=producer_build_failed error=%r", one_line(exc))
                    with self._lock:
                        self._building -= 1
                    time.sleep(1.0)
                    break
                with self._lock:
                    self._building -= 1
                    if self._closed:
                        closed = producer
                    else:
                        # Lent after the producers given back (the list's end), by then
                        # with its producer id.
                        self._idle.insert(0, (producer, time.monotonic()))
                        closed = None
                if closed is not None:
                    closed.close(timeout=0.0)
                    return

    def _build(self) -> KafkaProducer:
        producer = self._factory()
        with self._lock:
            self.built += 1
        return producer
