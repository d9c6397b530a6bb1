"""The relay's sessions as the database URL and the role make them: the URL's ``options`` are
kept (merged with the settings the relay pins), and a least-privilege role is enough to deliver,
with ``--check`` and ``/readyz`` saying when it is not (docs/concepts.md I15)."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
import uuid

import pytest
import sqlalchemy as sa

from outbox import cli, migrate
from outbox._metrics_server import MetricsServer
from outbox.cli import relay as relay_cli
from outbox.relay import Relay, RelayConfig
from tests.fixtures.common import wait_for
from tests.fixtures.relay import RelayThread, insert_rows, outbox_count, wait_for_records


def _with_options(database_url: str, options: str) -> str:
    url = sa.make_url(database_url).update_query_dict({"options": options})
    return url.render_as_string(hide_password=False)


def test_the_urls_search_path_is_kept_and_the_relay_check_and_status_name_the_same_table(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE SCHEMA billing")
    billing_url = _with_options(database_url, "-c search_path=billing")
    billing = sa.create_engine(billing_url)
    try:
        migrate.upgrade(billing)  # the toolkit's tables in billing, as the application sees them
        topic = f"relay-options-{uuid.uuid4().hex[:8]}"
        events = insert_rows(billing, topic, [("k", b"v")])
        with engine.connect() as conn:  # the application wrote to billing's outbox, not public's
            assert conn.exec_driver_sql("SELECT count(*) FROM billing.outbox").scalar_one() == 1
            assert conn.exec_driver_sql("SELECT count(*) FROM public.outbox").scalar_one() == 0

        # The relay serves the table the application wrote to: the event ships.
        relay = Relay(RelayConfig(billing_url, kafka_bootstrap))
        try:
            relay.run(once=True)
        finally:
            relay.engine.dispose()
        wait_for_records(kafka_bootstrap, topic, events, timeout=10)
        assert relay.table_name == "billing.outbox"

        # --check and status agree on that table, and name it.
        events += insert_rows(billing, topic, [("k", b"v")])
        capsys.readouterr()
        code = relay_cli.main(
            ["--database-url", billing_url, "--bootstrap-servers", kafka_bootstrap, "--check"]
        )
        out = capsys.readouterr()
        assert code == 0, out.err
        assert "table billing.outbox" in out.out

        assert cli.main(["status", "--database-url", billing_url, "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert status["table"] == "billing.outbox" and status["schema"] == "billing"
        assert status["outbox"]["pending"] == 1
        assert cli.main(["status", "--database-url", billing_url]) == 0
        assert "table billing.outbox" in capsys.readouterr().out

    finally:
        billing.dispose()


def test_the_relay_pins_its_isolation_over_the_urls_and_keeps_the_rest(
    database_url: str, kafka_bootstrap: str
) -> None:
    url = _with_options(
        database_url,
        "-c default_transaction_isolation=serializable -c jit=on -c statement_timeout=7s",
    )
    relay = Relay(RelayConfig(url, kafka_bootstrap))
    try:
        with relay.engine.connect() as conn:
            shown = conn.exec_driver_sql(
                "SELECT current_setting('transaction_isolation'), current_setting('jit'), "
                "current_setting('statement_timeout'), current_setting('enable_nestloop')"
            ).one()
    finally:
        relay.engine.dispose()
    assert tuple(shown) == ("read committed", "on", "7s", "off")


def _as(database_url: str, role: str) -> str:
    return sa.make_url(database_url).set(username=role).render_as_string(hide_password=False)


def _revoke(engine: sa.Engine, grant: str) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(f"REVOKE {grant} FROM outbox_relay")


def _readyz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_relay_with_the_role_scripts_grants_delivers_with_its_mark(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    relay_role: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="outbox.relay")
    url = _as(database_url, relay_role)
    topic = f"relay-role-{uuid.uuid4().hex[:8]}"
    events = insert_rows(engine, topic, [(f"k{i}", b"v") for i in range(20)])
    relay = Relay(RelayConfig(url, kafka_bootstrap, batch_size=5))
    try:
        assert relay.check() == []
        relay.run(once=True)
    finally:
        relay.engine.dispose()
    wait_for_records(kafka_bootstrap, topic, events)
    assert outbox_count(engine) == 0
    assert not [r for r in caplog.records if "event=low_water_off" in r.getMessage()]


def test_without_the_sequence_privilege_the_relay_still_delivers_and_says_so_once(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    relay_role: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="outbox.relay")
    _revoke(engine, "SELECT ON SEQUENCE outbox_id_seq")
    topic = f"relay-noseq-{uuid.uuid4().hex[:8]}"
    events = insert_rows(engine, topic, [(f"k{i}", b"v") for i in range(20)])
    relay = RelayThread(RelayConfig(_as(database_url, relay_role), kafka_bootstrap, batch_size=5))
    relay.start()
    try:
        wait_for(lambda: outbox_count(engine) == 0, 15, "the relay to send every row")
        more = insert_rows(engine, topic, [("later", b"v")])
        relay.relay.kick.set()
        wait_for(lambda: outbox_count(engine) == 0, 15, "the relay to send the later row")
    finally:
        relay.stop()
    wait_for_records(kafka_bootstrap, topic, events + more)
    off = [r.getMessage() for r in caplog.records if "event=low_water_off" in r.getMessage()]
    assert len(off) == 1 and "reason=privilege" in off[0], off
    assert "GRANT SELECT ON SEQUENCE public.outbox_id_seq" in off[0]


@pytest.mark.parametrize("privilege", ["DELETE", "UPDATE"])
def test_a_role_that_cannot_run_a_batch_fails_the_check_and_readyz_naming_the_privilege(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    relay_role: str,
    privilege: str,
) -> None:
    _revoke(engine, f"{privilege} ON outbox")
    url = _as(database_url, relay_role)
    checked = Relay(RelayConfig(url, kafka_bootstrap))
    try:
        problems = checked.check()
    finally:
        checked.engine.dispose()
    assert len(problems) == 1 and f"lacks {privilege} on public.outbox" in problems[0], problems

    relay = RelayThread(RelayConfig(url, kafka_bootstrap, stats_interval=0.2))
    server = MetricsServer(relay.relay.metrics, 0, max_silence=30).start()
    relay.start()
    try:
        wait_for(lambda: relay.relay.metrics.database_up, 15, "the relay to connect")
        wait_for(lambda: relay.relay.metrics.broker_up, 15, "the broker check")
        assert _readyz(server.port) == 503
        assert relay.relay.metrics.missing_privileges == [privilege]
        with engine.begin() as conn:  # granted again: ready at the next stats refresh
            conn.exec_driver_sql(f"GRANT {privilege} ON outbox TO outbox_relay")
        wait_for(lambda: _readyz(server.port) == 200, 15, "/readyz to answer 200")
    finally:
        relay.stop()
        server.close()
