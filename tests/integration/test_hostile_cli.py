"""Hostile command lines and ``OUTBOX_*`` variables: every flag and variable either works or
makes the command exit with its usage code (2) and one clear line on stderr -- no traceback,
no secret, nothing written. Run in-process against this test's database; the relay and the
consumer runner, which would start serving, are checked up to the settings they would run
with (the same code their commands run first), and run whole when those are refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given, strategies as st

from outbox import cli
from outbox.cli import consume as consume_cli, relay as relay_cli
from outbox.errors import ConfigurationError, ValidationError
from tests.fixtures.hostile import (
    CONSUMER_RULES,
    HOSTILE_TEXT,
    RELAY_RULES,
    TALLY,
    attempt,
    environment,
    no_leak,
    obeys,
    outbox_variables,
    scaled,
)

FAMILY = "CLI flags and OUTBOX_* variables"
NUMBERISH = st.sampled_from(
    ["0", "-1", "1", "5", "100", "nan", "inf", "-inf", "1e309", "99999999999999999999", " 7",
     "7\n", "0x10", "1_000", "", "abc", "½", "٣", "65536", "70000", "4097", "1.5"]
)  # fmt: skip
DURATIONS = st.sampled_from(
    ["7d", "8d", "1d", "0", "-1d", "nan", "1e400", "99999999999w", "1.5h", "36h", "7 d", "d",
     "", "10000000000000000000000s", "1d1d", "٣d"]
)  # fmt: skip
VALUES = st.one_of(NUMBERISH, DURATIONS, HOSTILE_TEXT, st.sampled_from(["default", "orders"]))
TOKEN = "Tk9q8w7e6r5t4y"


def db_url_list(url: str) -> list[str]:
    """The test database's URL, with a password (trust authentication ignores it) written
    well or badly."""
    rest = url.split("://", 1)[1].split("@", 1)[1]
    return [
        f"postgresql+psycopg://postgres:{TOKEN}@{rest}",
        f"postgresql://postgres:{TOKEN}%40x@{rest}",
        f"postgresql+psycopg://postgres:{TOKEN}@x@{rest}",  # "@" not encoded
        f"postgresql+psycopg://postgres:{TOKEN}%zz@{rest}",  # "%" not encoded
        f"postgresql+psycopg://postgres:{TOKEN} x@{rest}",
        f"postgresql+psycopg://postgres:{TOKEN}@{rest.replace(':5432', ':54x32')}",
        f"postgresql+psycopg://postgres:{TOKEN}@{rest}?password={TOKEN}",
        f"mysql://postgres:{TOKEN}@{rest}",
        f"postgresql+psycopg://postgres:{TOKEN}",
        f"{TOKEN}",
        f"postgresql+psycopg://postgres:{TOKEN}@{rest}\n",
    ]


def db_urls(url: str) -> st.SearchStrategy[str]:
    return st.sampled_from(db_url_list(url))


KAFKA_CONFIG = st.sampled_from(
    [
        f"sasl.password={TOKEN}",
        f"sasl.password:{TOKEN}",
        f"{TOKEN}",
        f"sasl.username=u,sasl.password={TOKEN}",
        f"ssl.key.pem={TOKEN}\x01",
        f"bad name={TOKEN}",
        "acks=0",
        "message.timeout.ms=0",
        "linger.ms=5",
        "enable.idempotence=false",
    ]
)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in outbox_variables():
        monkeypatch.delenv(name)


def _run(main: Callable[[list[str]], int], argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        return int(exc.code or 0)


def _check_output(code: int, out: str, err: str, allowed: set[int]) -> None:
    assert code in allowed, (code, err)
    assert "Traceback" not in err, err
    no_leak(FAMILY, TOKEN, out, err)
    if code == 2:
        lines = err.strip("\n").splitlines()
        assert len(lines) == 1, err  # one clear line
        assert re.match(r"outbox[\w -]*: error: ", lines[0]), err


# ---------------------------------------------------------------- operator commands, whole

OPERATOR_FLAGS: dict[str, tuple[list[str], str | None, set[int]]] = {
    # flag: (command, its variable, exit codes other than 0 and 2 that are documented)
    "--schema": (["status"], "OUTBOX_SCHEMA", {1}),  # 1: no tables in that schema
    "--lanes": (["status"], "OUTBOX_RELAY_LANES", set()),
    "--log-level": (["status"], "OUTBOX_LOG_LEVEL", set()),
    "--older-than": (["gc", "--dry-run"], "OUTBOX_RETENTION", {3}),
    "--cache-ttl": (["gc", "--dry-run", "--older-than", "30d"], "OUTBOX_CACHE_TTL", {3}),
    "--min-redelivery-window": (
        ["gc", "--dry-run", "--older-than", "30d"],
        "OUTBOX_MIN_REDELIVERY_WINDOW",
        {3},
    ),
    "--batch-size": (["gc", "--dry-run", "--older-than", "30d"], "OUTBOX_GC_BATCH_SIZE", set()),
    "--duty-cycle": (["gc", "--dry-run", "--older-than", "30d"], "OUTBOX_GC_DUTY_CYCLE", set()),
    "--scope": (["gc", "--dry-run", "--older-than", "30d"], None, set()),
    "--topic": (["parked", "list"], None, set()),
    "--limit": (["parked", "list"], None, set()),
    "--revision": (["migrate"], None, {1}),  # 1: alembic cannot go there from here
    "--lock-timeout": (["migrate"], "OUTBOX_MIGRATE_LOCK_TIMEOUT", set()),
    "--lock-attempts": (["migrate"], "OUTBOX_MIGRATE_LOCK_ATTEMPTS", set()),
}


# The documented range of the operator commands' integer flags.
INTEGER_FLAGS = {"--lanes": (1, 4096), "--batch-size": (1, 100_000), "--limit": (1, 100_000)}


def fields_of(config: object) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}  # type: ignore[arg-type]


def counts(engine: sa.Engine) -> tuple[int, ...]:
    with engine.connect() as conn:
        return tuple(
            conn.execute(
                sa.text(
                    "SELECT (SELECT count(*) FROM idempotency_keys), "
                    "(SELECT count(*) FROM outbox), (SELECT count(*) FROM outbox_cache_secret)"
                )
            ).one()
        )


@scaled(120)
@given(
    flag=st.sampled_from(sorted(OPERATOR_FLAGS)),
    value=VALUES,
    via=st.sampled_from(["flag", "variable"]),
    url_choice=st.integers(0, 30),
)
def test_operator_commands(
    engine: sa.Engine,
    database_url: str,
    capsys: pytest.CaptureFixture[str],
    flag: str,
    value: str,
    via: str,
    url_choice: int,
) -> None:
    command, variable, other_codes = OPERATOR_FLAGS[flag]
    urls = db_url_list(database_url)
    url = urls[url_choice] if url_choice < len(urls) else urls[0]
    if via == "variable" and variable is None:
        via = "flag"
    argv = [*command, "--database-url", url]
    env: dict[str, str] = {}
    if via == "flag":
        argv.append(f"{flag}={value}")
    else:
        assert variable is not None
        env[variable] = value
    capsys.readouterr()

    before = counts(engine)
    with environment(env):
        code = attempt(FAMILY, lambda: _run(cli.main, argv), ())
    out, err = capsys.readouterr()
    assert isinstance(code, int)
    _check_output(code, out, err, {0, 2} | other_codes)
    if code == 2:
        TALLY.refused[FAMILY] += 1
    # Accepted: then it was an integer within the rule (an empty variable counts as unset).
    if code == 0 and flag in INTEGER_FLAGS and not (via == "variable" and value == ""):
        low, high = INTEGER_FLAGS[flag]
        try:
            number = int(value.strip())
        except ValueError:
            pytest.fail(f"{flag}={value!r} is not an integer, yet the command exited 0")
        assert low <= number <= high, f"{flag}={value!r} accepted outside {low}..{high}"
    assert counts(engine) == before


# ------------------------------------------------------ the relay and the consumer runner


RELAY_FLAGS = {
    "--bootstrap-servers": "OUTBOX_KAFKA_BOOTSTRAP_SERVERS",
    "--batch-size": "OUTBOX_RELAY_BATCH_SIZE",
    "--poll-interval": "OUTBOX_RELAY_POLL_INTERVAL",
    "--lanes": "OUTBOX_RELAY_LANES",
    "--max-attempts": "OUTBOX_RELAY_MAX_ATTEMPTS",
    "--rebalance-interval": "OUTBOX_RELAY_REBALANCE_INTERVAL",
    "--metrics-port": "OUTBOX_RELAY_METRICS_PORT",
    "--metrics-host": "OUTBOX_METRICS_HOST",
    "--schema": "OUTBOX_SCHEMA",
    "--log-level": "OUTBOX_LOG_LEVEL",
    "--kafka-config": "OUTBOX_KAFKA_CONFIG",
    "--database-url": "OUTBOX_DATABASE_URL",
}
CONSUMER_FLAGS = {
    "--topic": None,
    "--group": "OUTBOX_CONSUMER_GROUP",
    "--scope": None,
    "--key-header": None,
    "--max-attempts": None,
    "--dlq-suffix": None,
    "--metrics-port": "OUTBOX_CONSUMER_METRICS_PORT",
    "--metrics-host": "OUTBOX_METRICS_HOST",
    "--redis-url": "OUTBOX_REDIS_URL",
    "--bootstrap-servers": "OUTBOX_KAFKA_BOOTSTRAP_SERVERS",
    "--kafka-config": "OUTBOX_KAFKA_CONFIG",
    "--database-url": "OUTBOX_DATABASE_URL",
    "--schema": "OUTBOX_SCHEMA",
    "HANDLER": None,
}


def _settings(parse: Callable[[], argparse.Namespace], build: Callable[[Any], object]) -> object:
    try:
        args = parse()
    except SystemExit as exc:
        raise ConfigurationError(f"argparse refused the command line (exit {exc.code})") from exc
    return build(args)


@scaled(150)
@given(
    service=st.sampled_from(["relay", "consume"]),
    data=st.data(),
    via=st.sampled_from(["flag", "variable"]),
)
def test_relay_and_consumer_commands(
    database_url: str,
    capsys: pytest.CaptureFixture[str],
    service: str,
    data: st.DataObject,
    via: str,
) -> None:
    flags = RELAY_FLAGS if service == "relay" else CONSUMER_FLAGS
    flag = data.draw(st.sampled_from(sorted(flags)), label="flag")
    if flag == "--database-url":
        value = data.draw(db_urls(database_url), label="value")
    elif flag == "--kafka-config":
        value = data.draw(KAFKA_CONFIG, label="value")
    else:
        value = data.draw(VALUES, label="value")
    variable = flags[flag]
    if via == "variable" and variable is None:
        via = "flag"
    base = ["--database-url", database_url, "--bootstrap-servers", "127.0.0.1:9"]
    if service == "relay":
        argv = [*base, "--once"]
        main: Callable[[list[str]], int] = relay_cli.main

        def parse() -> argparse.Namespace:
            return relay_cli.build_parser().parse_args(argv)

        def build(args: argparse.Namespace) -> object:
            config = relay_cli.config_from_args(args)
            obeys(RELAY_RULES, fields_of(config))  # accepted must mean within the rule
            return relay_cli.producer_config(config.bootstrap_servers, config.kafka_config)

    else:
        handler = value if flag == "HANDLER" else "json:loads"
        argv = ["consume", handler, "--topic", "orders", "--group", "billing", *base]
        main = cli.main

        def parse() -> argparse.Namespace:
            return cli.build_parser(argv).parse_args(argv)

        def build(args: argparse.Namespace) -> object:
            config = consume_cli.config_from_args(args)
            obeys(CONSUMER_RULES, fields_of(config))
            obeys(RELAY_RULES, {"metrics_port": args.metrics_port})
            return config

    env: dict[str, str] = {}
    if flag != "HANDLER":
        if via == "flag":
            argv.append(f"{flag}={value}")
        else:
            assert variable is not None
            env[variable] = value
    capsys.readouterr()
    with environment(env):
        outcome = attempt(
            FAMILY, lambda: _settings(parse, build), (ConfigurationError, ValidationError)
        )
        if isinstance(outcome, BaseException):
            no_leak(FAMILY, TOKEN, str(outcome))
            # The command refuses them too, with its usage code, before any I/O.
            capsys.readouterr()
            code = _run(main, argv)
            out, err = capsys.readouterr()
            _check_output(code, out, err, {2})
