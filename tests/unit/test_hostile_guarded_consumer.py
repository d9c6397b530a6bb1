"""Hostile settings of the consumer under the Redis guard, without services.

The runner's settings with a guard (``batch_size``, handlers, the guard's own ``lease``,
``on_redis_error``, ``permanent_errors``), and ``outbox consume``'s guard flags and their
``OUTBOX_GUARD_*`` variables, alone or mixed with the outbox's flags: each either gives settings
to run with or raises a ConfigurationError / ValidationError before any I/O (no Redis, broker or
database is reachable here), and the password of a guard URL never shows in what is said.
"""

from __future__ import annotations

import argparse
import asyncio
import traceback
from typing import Any

import pytest
from hypothesis import given, strategies as st
from prometheus_client import CollectorRegistry

from outbox import cli
from outbox.cli import consume as consume_cli
from outbox.consumer import AsyncConsumerRunner, ConsumerConfig, ConsumerRunner, batch_handler
from outbox.errors import ConfigurationError, ValidationError
from outbox.guard import AsyncRedisGuard, RedisGuard
from tests.fixtures.hostile import (
    HOSTILE_STR_OR_NOT,
    HOSTILE_TEXT,
    attempt,
    environment,
    no_leak,
    outbox_variables,
    scaled,
)

INPUT = (ValidationError, ConfigurationError)
NOWHERE = "redis://127.0.0.1:1/0"  # nothing listens: a connection attempt would fail the test
TOKEN = "Tk3v8n2m7q1w"

NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2, 0.5, 1e300, True, None, "1"]),
)
EXCEPTION_CLASSES = st.one_of(
    st.just((ValueError,)),
    st.just([KeyError, OSError]),
    st.just(ValueError),
    st.just(("ValueError",)),
    st.just((ValueError, 3)),
    st.just((int,)),
    HOSTILE_STR_OR_NOT,
)


def plain(claim: Any, message: Any) -> None:
    return None


async def coroutine(claim: Any, message: Any) -> None:
    return None


HANDLERS = st.sampled_from(
    [plain, coroutine, batch_handler(lambda batch: None), "handler", None, print]
)


GOOD = {"batch_size": 1, "handler": plain, "lease": 30, "policy": "closed", "permanent": ()}
HOSTILE = {
    "batch_size": NUMBERS,
    "handler": HANDLERS,
    "lease": NUMBERS,
    "policy": st.one_of(st.just("open"), HOSTILE_STR_OR_NOT),
    "permanent": EXCEPTION_CLASSES,
}


@scaled(150)
@given(
    hostile=st.sampled_from([*HOSTILE, "none", "all"]).flatmap(
        lambda name: st.fixed_dictionaries(
            HOSTILE if name == "all" else ({name: HOSTILE[name]} if name in HOSTILE else {})
        )
    ),
    flavour=st.sampled_from(["sync", "asyncio"]),
    given_as=st.sampled_from(["keywords", "config"]),
)
def test_guarded_runner_settings(hostile: dict[str, Any], flavour: str, given_as: str) -> None:
    chosen = {**GOOD, **hostile}
    batch_size, handler, lease = chosen["batch_size"], chosen["handler"], chosen["lease"]
    policy, permanent = chosen["policy"], chosen["permanent"]
    if flavour == "asyncio" and handler is plain:
        handler = coroutine
    settings: dict[str, Any] = {
        "topics": ["orders"], "group": "billing", "bootstrap_servers": "k:9092",
        "batch_size": batch_size,
    }  # fmt: skip
    guards: list[Any] = []

    def build() -> object:
        guard_type = RedisGuard if flavour == "sync" else AsyncRedisGuard
        guard = guard_type(NOWHERE, lease=lease, on_redis_error=policy, permanent_errors=permanent)
        guards.append(guard)
        runner_type = ConsumerRunner if flavour == "sync" else AsyncConsumerRunner
        registry = CollectorRegistry()
        if given_as == "config":
            return runner_type(
                guard, handler, ConsumerConfig(**settings), metrics_registry=registry
            )
        return runner_type(guard, handler, metrics_registry=registry, **settings)

    try:
        outcome = attempt("guarded consumer settings", build, INPUT)
    finally:
        for guard in guards:
            if isinstance(guard, AsyncRedisGuard):
                asyncio.run(guard.aclose())
            else:
                guard.close()
    if not isinstance(outcome, BaseException):
        runner: Any = outcome
        assert runner.config.batch_size == 1 and runner.outbox is None
        assert runner.guard.settings.on_redis_error in ("closed", "open")


# ------------------------------------------------------------------ outbox consume's flags

GUARD_URLS = st.sampled_from(
    [
        f"redis://:{TOKEN}@127.0.0.1:1/0",
        f"redis://user:{TOKEN}@127.0.0.1:1",
        f"rediss://:{TOKEN}@h:1/0",
        f"redis://:{TOKEN}@@h:1/0",  # "@" not encoded
        f"redis://:{TOKEN}%zz@h:1/0",
        f"redis://:{TOKEN}@h:99999/0",
        f"redis://h:1/0?password={TOKEN}",
        f"http://:{TOKEN}@h:1",
        f"{TOKEN}",
        "redis://127.0.0.1:1/0",
        "unix:///tmp/redis.sock",
    ]
)
NUMBERISH = st.sampled_from(
    ["0", "-1", "1", "2", "30", "0.005", "nan", "inf", "1e309", "86401", " 7", "", "abc", "٣"]
)
POLICIES = st.one_of(st.sampled_from(["closed", "open", "CLOSED", "", "fail"]), HOSTILE_TEXT)
OUTBOX_SIDE = st.sampled_from(
    [
        (),
        (),
        ("--database-url", "postgresql+psycopg://app@db/app"),
        ("--redis-url", "redis://cache:6379/0"),
        ("--schema", "billing"),
    ]
)
VARIABLES = {
    "--guard-redis-url": "OUTBOX_GUARD_REDIS_URL",
    "--guard-lease": "OUTBOX_GUARD_LEASE",
    "--guard-on-redis-error": "OUTBOX_GUARD_ON_REDIS_ERROR",
    "--database-url": "OUTBOX_DATABASE_URL",
    "--redis-url": "OUTBOX_REDIS_URL",
    "--schema": "OUTBOX_SCHEMA",
}


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in outbox_variables():
        monkeypatch.delenv(name)


@scaled(200)
@given(
    url=st.one_of(st.none(), st.just("redis://127.0.0.1:1/0"), GUARD_URLS),
    lease=st.one_of(st.none(), st.just("2.5"), NUMBERISH),
    policy=st.one_of(st.none(), st.just("open"), POLICIES),
    batch_size=st.sampled_from([None, None, "1", "2", "500", "0", "x"]),
    cluster=st.booleans(),
    outbox_side=OUTBOX_SIDE,
    via=st.lists(st.sampled_from(["flag", "variable"]), min_size=4, max_size=4),
)
def test_consume_guard_flags(
    capsys: pytest.CaptureFixture[str],
    url: str | None,
    lease: str | None,
    policy: str | None,
    batch_size: str | None,
    cluster: bool,
    outbox_side: tuple[str, ...],
    via: list[str],
) -> None:
    argv = ["consume", "json:loads", "--topic", "orders", "--group", "billing",
            "--bootstrap-servers", "127.0.0.1:9"]  # fmt: skip
    env: dict[str, str] = {}
    chosen = [("--guard-redis-url", url), ("--guard-lease", lease),
              ("--guard-on-redis-error", policy)]  # fmt: skip
    if outbox_side:
        chosen.append(outbox_side)
    for (flag, value), how in zip(chosen, via, strict=False):
        if value is None:
            continue
        if how == "flag":
            argv.append(f"{flag}={value}")
        else:
            env[VARIABLES[flag]] = value
    # An empty OUTBOX_* variable counts as unset (outbox.config.env), as everywhere.
    unset = {flag for (flag, value), how in zip(chosen, via, strict=False)
             if how == "variable" and value == ""}  # fmt: skip
    url = None if "--guard-redis-url" in unset else url
    lease = None if "--guard-lease" in unset else lease
    policy = None if "--guard-on-redis-error" in unset else policy
    if batch_size is not None:
        argv.append(f"--batch-size={batch_size}")
    if cluster:
        argv.append("--guard-cluster")

    def build() -> ConsumerConfig:
        try:
            args: argparse.Namespace = cli.build_parser(argv).parse_args(argv)
        except SystemExit as exc:
            raise ConfigurationError(f"argparse refused the command line ({exc.code})") from exc
        return consume_cli.config_from_args(args)

    capsys.readouterr()
    with environment(env):
        outcome = attempt("outbox consume guard flags", build, INPUT)
    out, err = capsys.readouterr()
    no_leak("URL secrets", TOKEN, out, err)
    if isinstance(outcome, BaseException):
        no_leak("URL secrets", TOKEN, "".join(traceback.format_exception(outcome)))
        return
    guarded = url is not None
    # Accepted: a guarded consumer has no outbox setting and runs one message at a time; an
    # outbox consumer has its database URL and no guard setting.
    if guarded:
        assert not outbox_side and outcome.batch_size == 1
    else:
        assert outbox_side[:1] == ("--database-url",)
        assert lease is None and policy is None and not cluster
