"""A relay fleet: one ``outbox-relay`` process serving many databases, several processes sharing
them without a coordinator of their own.

Each database is served by a :class:`outbox.relay.Relay` of its own, on a thread of its own,
with every invariant it has alone (no loss, per-key order, parking, SIGKILL safety): one
database down, unmigrated or refusing only keeps its own relay reconnecting with backoff, and
its log lines carry its name. The fleet's loop, every ``membership_interval``:

1. every ``refresh_interval``, reads the list of databases again (the URLs given, the
   databases file, the discovery query); databases added start, databases gone stop;
2. reads the live members from ``pg_locks`` of the membership database (this process holds
   its own member lock there);
3. serves the databases rendezvous hashing gives this member (:mod:`outbox._core.fleet`) and
   stops serving the others.

Each relay listens for wake-ups on its own session (the one that holds the serving lock and
the lanes: one connection per database served); while relays wait for work, one
:class:`outbox._pg.fleet.FleetListener` thread watches their sockets, so an idle fleet costs a
poll per database every ``--poll-interval`` and nothing in between.

A relay takes the database's serving lock on its own session before it registers for lanes
(``Relay(on_session=...)``), waiting while the previous server still holds it: at most one
process serves a database at a time, and the lock dies with a killed process's sessions, so
the next member takes over at its next turn of the loop (about ``membership_interval``).
When the membership database cannot be reached, every member serves whatever it can lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from outbox._core.fleet import member_key, owner_of, parse_databases_file
from outbox._core.outage import Outage
from outbox._core.redact import one_line, redact_url
from outbox._kafka.producer import KafkaProducer
from outbox._pg import fleet as pg_fleet
from outbox._pg.errors import is_database_error
from outbox._pg.fleet import FleetListener
from outbox._pg.relay import listen_connector, relay_engine
from outbox.config import FleetConfig as FleetConfig, RelayConfig, normalize_database_url
from outbox.errors import ConfigurationError
from outbox.relay._fleet_metrics import FleetMetrics
from outbox.relay._producers import ProducerPool
from outbox.relay._relay import Relay, RunResult

log = logging.getLogger("outbox.relay")

# Loggers whose lines, written on a database's relay thread, get that database's name.
_TAGGED_LOGGERS = ("outbox.relay", "outbox.wakeup")
# Seconds between two tries of a serving lock another process still holds.
_OWNER_RETRY = 0.2
# Turns of the loop between two full readings of the members when no member announced
# itself (a member gone is seen at the next turn, a member that joined when it says so).
_FULL_READ = 5
# A fleet relay's statistics and lane rebalances: every this many poll intervals at most.
FLEET_SLOW_FACTOR = 4
# Not computed yet (an owner may be None: no member).
_UNKNOWN = object()


def database_identity(url: str) -> str:
    """What names a database for the rendezvous hash and the logs: ``host:port/name`` (the
    same for every member, whatever user or password its URL carries)."""
    parsed = sa.make_url(url)
    return f"{parsed.host or 'localhost'}:{parsed.port or 5432}/{parsed.database or ''}"


class _Tags(logging.Filter):
    """Appends ``database=<host:port/name>`` to lines logged on a database's relay thread."""

    def __init__(self) -> None:
        super().__init__()
        self.by_thread: dict[int, str] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        name = self.by_thread.get(record.thread or 0)
        if name is not None and isinstance(record.msg, str) and " database=" not in record.msg:
            record.msg = f"{record.msg} database={name.replace('%', '%%')}"
        return True


@dataclasses.dataclass
class _Served:
    """One database of the fleet, and its relay while this process serves it."""

    url: str
    identity: str
    relay: Relay | None = None
    thread: threading.Thread | None = None
    retry_at: float = 0.0
    owned: bool = False

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


class Fleet:
    """Serve the databases of ``config`` until :meth:`stop`."""

    def __init__(
        self,
        config: FleetConfig,
        *,
        producer_factory: Callable[[], KafkaProducer] | None = None,
    ) -> None:
        self.config = config.validate()
        self.key = member_key(config.member_id)
        self.stop_event = threading.Event()
        self.databases: dict[str, _Served] = {}  # by identity
        self.members: set[int] = {self.key}
        # The process's relays borrow their producers from one pool (idle producers cost).
        relay = self.config.relay
        outage = Outage("Kafka")
        self.producers = ProducerPool(
            producer_factory
            or (lambda: KafkaProducer(relay.bootstrap_servers, relay.kafka_config, outage=outage))
        )
        self._membership_url = normalize_database_url(config.membership_database())
        self._membership_engine = relay_engine(self._membership_url)
        self._membership: Any = None
        self._membership_lost = False
        self._duplicate_member = False
        self._turns_to_full = 0  # the next reading of the members is a full one
        self._listed: dict[str, list[str]] = {"given": list(config.database_urls)}
        self._tags = _Tags()
        self._listener = FleetListener()
        # /metrics of every database this member serves, with a database label.
        self.metrics = FleetMetrics(self)
        # A member that just joined waits one turn before serving, so that members starting
        # together see each other first instead of each serving everything for a moment.
        self._settle_until = 0.0
        # Each database's owner among the members ``_owners_for``.
        self._owners: dict[str, object] = {}
        self._owners_for: tuple[int, ...] = ()

    # ------------------------------------------------------------------------------ control

    def stop(self) -> None:
        """Ask every relay to finish its batch in hand, and the loop to return (safe from
        signal handlers)."""
        self.stop_event.set()
        for served in list(self.databases.values()):
            if served.relay is not None:
                served.relay.stop()

    @property
    def served(self) -> dict[str, Relay]:
        """The relays running now, by database identity (``host:port/name``)."""
        return {
            name: s.relay
            for name, s in self.databases.items()
            if s.relay is not None and s.running and s.owned
        }

    # ------------------------------------------------------------------------- the databases

    def _read_file(self) -> None:
        path = self.config.databases_file
        if path is None:
            return
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeError) as exc:
            log.warning(
                "event=databases_file_unreadable path=%r error=%r: serving the databases "
                "read before",
                path,
                type(exc).__name__,
            )
            return
        self._listed["file"] = parse_databases_file(text)

    def _discover(self) -> None:
        url = self.config.discover_url
        pattern = self.config.discover_pattern
        if url is None or pattern is None:
            return
        normalized = normalize_database_url(url)
        connection: Any = None
        try:
            connection = listen_connector(relay_engine(normalized))()
            connection.autocommit = True
            names = pg_fleet.discover_databases(connection, pattern)
        except Exception as exc:
            if not (is_database_error(exc) or isinstance(exc, OSError)):
                raise
            log.warning(
                "event=discovery_failed server=%s error=%r: serving the databases found before",
                redact_url(normalized),
                one_line(exc, urls=[normalized], with_type=False),
            )
            return
        finally:
            if connection is not None:
                with contextlib.suppress(Exception):
                    connection.close()
        base = sa.make_url(normalized)
        self._listed["discovered"] = [
            base.set(database=name).render_as_string(hide_password=False) for name in names
        ]

    def refresh(self) -> None:
        """Read the databases again: start tracking the new ones, stop serving the gone ones."""
        self._read_file()
        self._discover()
        wanted: dict[str, str] = {}
        for source, urls in self._listed.items():
            for raw in urls:
                try:
                    url = normalize_database_url(raw)
                    identity = database_identity(url)
                except (ConfigurationError, sa.exc.ArgumentError, ValueError):
                    log.warning(
                        "event=database_url_invalid source=%s url=%s", source, redact_url(raw)
                    )
                    continue
                wanted.setdefault(identity, url)
        for identity, url in wanted.items():
            if identity not in self.databases:
                self.databases[identity] = _Served(url, identity)
                log.info("event=database_added database=%s", identity)
        for identity in list(self.databases):
            if identity not in wanted:
                served = self.databases.pop(identity)
                self._owners.pop(identity, None)
                log.info("event=database_removed database=%s", identity)
                self._release(served)

    # ------------------------------------------------------------------------------ members

    def see_members(self) -> None:
        """Read the live members (holding this member's own lock); alone, when the membership
        database does not answer: then every member serves what it can lock."""
        try:
            if self._membership is None:
                connection = listen_connector(self._membership_engine)()
                connection.autocommit = True
                try:
                    joined = pg_fleet.member_join(connection, self.config.relay.schema, self.key)
                    if not joined:
                        # Another member's liveness probe holds the key for a statement's
                        # time: a second try tells it from a live duplicate.
                        time.sleep(0.05)
                        joined = pg_fleet.member_join(
                            connection, self.config.relay.schema, self.key
                        )
                except Exception:
                    connection.close()
                    raise
                if not joined:
                    connection.close()
                    if not self._duplicate_member:
                        log.error(
                            "event=member_id_in_use member=%r: another live process runs with "
                            "this --member-id; give each process its own",
                            self.config.member_id,
                        )
                    self._duplicate_member = True
                    self.members = {self.key}
                    return
                self._duplicate_member = False
                self._membership = connection
                self._settle_until = time.monotonic() + self.config.membership_interval
            members = self._read_members(self._membership)
        except Exception as exc:
            if not (is_database_error(exc) or isinstance(exc, OSError)):
                raise
            self._drop_membership()
            if not self._membership_lost:
                log.warning(
                    "event=membership_unreachable database=%s error=%r: serving every database "
                    "this process can lock until it answers",
                    redact_url(self._membership_url),
                    one_line(exc, urls=[self._membership_url], with_type=False),
                )
            self._membership_lost = True
            self.members = {self.key}
            return
        if self._membership_lost:
            log.info("event=membership_back members=%d", len(members | {self.key}))
            self._membership_lost = False
        members.add(self.key)
        if members != self.members:
            log.info(
                "event=fleet_members members=%d member=%r", len(members), self.config.member_id
            )
        self.members = members

    def _read_members(self, connection: Any) -> set[int]:
        """The live members: from ``pg_locks`` when a member announced that it joined, and
        every ``_FULL_READ`` turns anyway; in between only whether a member known alive is
        gone (one small statement instead of a copy of every lock of the server)."""
        schema = self.config.relay.schema
        others = sorted(self.members - {self.key})
        self._turns_to_full -= 1
        if pg_fleet.member_announced(connection):
            self._turns_to_full = 0
        if self._turns_to_full > 0 and not pg_fleet.members_gone(connection, schema, others):
            return set(self.members)
        self._turns_to_full = _FULL_READ
        return pg_fleet.live_members(connection, schema)

    def _drop_membership(self) -> None:
        self._turns_to_full = 0
        connection, self._membership = self._membership, None
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.close()

    # --------------------------------------------------------------------------- assignment

    def assign(self) -> None:
        """Serve the databases that rank this member first; give back the others."""
        now = time.monotonic()
        if now < self._settle_until:
            return
        alive = tuple(sorted(self.members))
        if alive != self._owners_for:
            # Rendezvous hashing, once per change of the members (not every turn).
            self._owners.clear()
            self._owners_for = alive
        for served in self.databases.values():
            owner = self._owners.get(served.identity, _UNKNOWN)
            if owner is _UNKNOWN:
                owner = self._owners[served.identity] = owner_of(served.identity, alive)
            mine = owner == self.key
            if mine and not served.running and now >= served.retry_at:
                self._serve(served)
            elif not mine and served.running:
                self._release(served)

    def _relay_config(self, url: str) -> RelayConfig:
        template = self.config.relay
        # An idle database costs its relay a claim every poll interval, and the table's
        # statistics and a lane rebalance when they are due: with a hundred databases those
        # are the whole idle cost of the fleet (wake-ups come by notification). Statistics
        # and rebalances come every fourth poll at most: one process serves a database at a
        # time (the serving lock), so its relay takes every lane at its first rebalance
        # (at once) and has nobody to share them with later; the statistics feed the logs
        # and the backlog figures of /metrics (that old at most), while `outbox status`
        # reads each database itself.
        slow = FLEET_SLOW_FACTOR * template.poll_interval
        return dataclasses.replace(
            template,
            database_url=url,
            metrics_port=None,
            stats_interval=max(template.stats_interval, slow),
            rebalance_interval=max(template.rebalance_interval, slow),
        )

    def _serve(self, served: _Served) -> None:
        served.owned = False
        relay = Relay(
            self._relay_config(served.url),
            producer_pool=self.producers,
            on_session=lambda conn: self._take_database(served, relay, watch, conn),
            listen=lambda kick: watch,
        )
        watch = self._listener.watch(self.config.relay.schema, relay.kick)
        served.relay = relay
        served.thread = threading.Thread(
            target=self._run_relay,
            args=(served, relay),
            name=f"outbox-relay {served.identity}",
            daemon=True,
        )
        served.thread.start()

    def _take_database(
        self, served: _Served, relay: Relay, watch: pg_fleet.Watch, conn: sa.Connection
    ) -> None:
        """On each new session of ``relay``: wait for the database's serving lock, then
        listen for wake-ups on that session."""
        waited = False
        while not pg_fleet.owner_try(conn, self.config.relay.schema):
            if not waited:
                log.info("event=database_waiting reason=served_elsewhere")
                waited = True
            if relay.stop_event.wait(_OWNER_RETRY):
                return
        watch.session(conn)
        served.owned = True
        log.info("event=database_served member=%r", self.config.member_id)

    def _run_relay(self, served: _Served, relay: Relay) -> None:
        assert served.thread is not None
        ident = threading.get_ident()
        self._tags.by_thread[ident] = served.identity
        try:
            result = relay.run()
            assert result is RunResult.FINISHED
        except Exception as exc:
            served.retry_at = time.monotonic() + self.config.refresh_interval
            log.error(
                "event=database_failed error=%r retry_in=%.0fs",
                one_line(exc, urls=[served.url], with_type=True),
                self.config.refresh_interval,
            )
        finally:
            served.owned = False
            self._tags.by_thread.pop(ident, None)

    def _release(self, served: _Served) -> None:
        """Stop serving ``served`` (its relay finishes the batch in hand on its own thread)."""
        if served.relay is not None and served.running:
            log.info("event=database_released database=%s", served.identity)
            served.relay.stop()

    # --------------------------------------------------------------------------------- loop

    def run(self) -> RunResult:
        """Serve until :meth:`stop`."""
        for name in _TAGGED_LOGGERS:
            logging.getLogger(name).addFilter(self._tags)
        log.info(
            "event=fleet_started member=%r membership=%s refresh_interval=%gs",
            self.config.member_id,
            redact_url(self._membership_url),
            self.config.refresh_interval,
        )
        next_refresh = 0.0
        try:
            self.producers.warm()
            while not self.stop_event.is_set():
                self.metrics.beat()
                self.producers.serve()
                now = time.monotonic()
                if now >= next_refresh:
                    self.refresh()
                    next_refresh = now + self.config.refresh_interval
                self.see_members()
                if self.stop_event.is_set():
                    break
                self.assign()
                self.stop_event.wait(self.config.membership_interval)
        finally:
            self._shutdown()
        return RunResult.FINISHED

    def _shutdown(self) -> None:
        self.stop()
        deadline = time.monotonic() + self.config.relay.shutdown_grace + 5.0
        for served in list(self.databases.values()):
            if served.thread is not None:
                served.thread.join(max(0.0, deadline - time.monotonic()))
        self.producers.close()
        self._drop_membership()
        self._membership_engine.dispose()
        self._listener.close()
        for name in _TAGGED_LOGGERS:
            logging.getLogger(name).removeFilter(self._tags)
        log.info("event=fleet_stopped databases=%d", len(self.databases))
