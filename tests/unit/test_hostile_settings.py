"""Hostile settings and secrets, without services: the relay's and the consumer runner's
settings, database and Redis URLs, ``--kafka-config`` and the one redaction function.

Settings either validate or raise a ConfigurationError / ValidationError (never a TypeError,
OverflowError, UnicodeError...); a password or a secret Kafka setting never appears in an
error message, a chained cause, a ``repr`` or a redacted text -- for well-formed and
malformed input alike. Each secret carries a random token, and the token is what is looked
for.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest
import sqlalchemy as sa
from hypothesis import example, given, strategies as st
from prometheus_client import CollectorRegistry

import outbox
from outbox._core.redact import (
    is_secret_setting,
    one_line,
    redact,
    redact_kafka_config,
    redact_text,
    redact_url,
)
from outbox._core.urls import check_database_url, check_redis_url
from outbox._kafka.config import producer_config
from outbox.cli._common import parse_kafka_config
from outbox.config import ConsumerConfig, RelayConfig
from outbox.consumer import ConsumerRunner
from outbox.errors import ConfigurationError, ValidationError
from tests.fixtures.hostile import (
    CONSUMER_RULES,
    HOSTILE_STR_OR_NOT,
    HOSTILE_TEXT,
    NOT_TEXT,
    RELAY_RULES,
    attempt,
    no_leak,
    obeys,
    scaled,
)

INPUT = (ValidationError, ConfigurationError)

NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 5, 0.5, 1e300, True, None, "5", 70000, 65536, -0.5, 3601]),
)


HASHABLE = st.one_of(HOSTILE_TEXT, st.integers(), st.none(), st.sampled_from(["acks", "linger.ms"]))


def one_hostile(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """No field, one field or every field of ``fields`` set to a generated value."""
    return st.sampled_from([*fields, "none", "all"]).flatmap(
        lambda name: st.fixed_dictionaries(
            fields if name == "all" else ({name: fields[name]} if name in fields else {})
        )
    )


# ---------------------------------------------------------------------- the relay's settings

RELAY_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "database_url": st.one_of(HOSTILE_STR_OR_NOT, st.just("postgres://u:p@h:5432/db")),
    "bootstrap_servers": st.one_of(HOSTILE_STR_OR_NOT, st.just("k1:9092,k2:9092")),
    "schema": HOSTILE_STR_OR_NOT,
    "kafka_config": st.one_of(
        NOT_TEXT,
        st.dictionaries(HASHABLE, st.one_of(HOSTILE_STR_OR_NOT, NUMBERS), max_size=3),
    ),
    **{
        name: NUMBERS
        for name in (
            "batch_size",
            "poll_interval",
            "lanes",
            "max_attempts",
            "rebalance_interval",
            "metrics_port",
            "backoff_initial",
            "backoff_max",
            "stats_interval",
            "shutdown_grace",
        )
    },
}


@scaled(150)
@given(fields=one_hostile(RELAY_FIELDS))
@example(fields={"metrics_port": 70000})
@example(fields={"poll_interval": float("nan")})
@example(fields={"backoff_initial": -1.0})
@example(fields={"lanes": 0})
def test_relay_settings(fields: dict[str, Any]) -> None:
    base = {"database_url": "postgresql+psycopg://app@db/app", "bootstrap_servers": "k:9092"}

    def build() -> dict[str, Any]:
        config = RelayConfig(**{**base, **fields}).validate()
        obeys(RELAY_RULES, fields)
        return producer_config(config.bootstrap_servers, config.kafka_config)

    attempt("relay settings", build, INPUT)


# -------------------------------------------------------------- the consumer runner's settings

CONSUMER_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "topics": st.one_of(
        HOSTILE_STR_OR_NOT, st.lists(HOSTILE_STR_OR_NOT, max_size=3), st.just(["orders"])
    ),
    "group": st.one_of(HOSTILE_STR_OR_NOT, st.just("billing")),
    "bootstrap_servers": st.one_of(HOSTILE_STR_OR_NOT, st.none()),
    "kafka_config": st.one_of(
        NOT_TEXT,
        st.dictionaries(HASHABLE, st.one_of(HOSTILE_STR_OR_NOT, NUMBERS), max_size=3),
        st.just({"enable.auto.commit": True}),
        st.just({"on_commit": print}),
    ),
    "scope": st.one_of(st.none(), HOSTILE_STR_OR_NOT),
    "key_header": HOSTILE_STR_OR_NOT,
    "dlq_topic_suffix": HOSTILE_STR_OR_NOT,
    **{
        name: NUMBERS
        for name in (
            "max_attempts",
            "retry_backoff",
            "retry_backoff_max",
            "in_progress_backoff",
            "in_progress_backoff_max",
            "dlq_timeout",
            "batch_size",
            "poll_timeout",
            "commit_interval",
        )
    },
}


@pytest.fixture(scope="module")
def idle_outbox() -> Iterator[outbox.Outbox]:
    ob = outbox.Outbox("postgresql+psycopg://nobody@127.0.0.1:1/none")  # never connects
    yield ob
    ob.close()


@scaled(150)
@given(fields=one_hostile(CONSUMER_FIELDS), through_runner=st.booleans())
@example(fields={"poll_timeout": float("nan")}, through_runner=True)
@example(fields={"retry_backoff": -0.5}, through_runner=False)
@example(fields={"batch_size": 0}, through_runner=False)
def test_consumer_runner_settings(
    idle_outbox: outbox.Outbox, fields: dict[str, Any], through_runner: bool
) -> None:
    base = {"topics": ["orders"], "group": "billing", "bootstrap_servers": "k:9092"}
    settings = {**base, **fields}

    def build() -> object:
        built: object
        if through_runner:
            built = ConsumerRunner(
                idle_outbox,
                lambda uow, message: None,
                metrics_registry=CollectorRegistry(),
                **settings,
            )
        else:
            built = ConsumerConfig(**settings).validate()
        obeys(CONSUMER_RULES, fields)
        return built

    attempt("consumer runner settings", build, INPUT)


# ------------------------------------------------------------------- URLs and their secrets

TOKEN = st.text("abcdefghijklmnopqrstuvwxyz0123456789", min_size=12, max_size=16).map(
    lambda t: "Tk" + t
)
USER_PARTS = st.sampled_from(["", "app", "user.name", "u@x", "a:b", "%", "%zz", "%41", " "])
PASSWORD_WRAPPING = st.tuples(
    st.sampled_from(["", "@", "%", "%zz", "/", ":", "#", "?", " ", "\n", "\ud800", "[", "@@"]),
    st.sampled_from(["", "@", "%", "%2", "/", ":", "#", "?", " ", "@h", "é"]),
)
HOSTS = st.sampled_from(["db", "127.0.0.1", "[::1]", "", "h:5432", "h:99999", "h:abc", "db.x-y"])
TAILS = st.sampled_from(["", "/app", "/a%zz", "/app?sslmode=require", "?password=", "/db#frag"])


@st.composite
def urls_with_a_secret(draw: st.DrawFn, schemes: tuple[str, ...]) -> tuple[str, str, bool]:
    """``(url, token, encoded)``: a URL whose password holds ``token``; ``encoded`` when the
    password was percent-encoded (so the URL is well formed)."""
    token = draw(TOKEN)
    before, after = draw(PASSWORD_WRAPPING)
    password = before + token + after
    encoded = draw(st.booleans())
    written = quote(password, safe="", errors="surrogatepass") if encoded else password
    user = draw(USER_PARTS)
    scheme = draw(st.sampled_from(schemes))
    shape = draw(st.sampled_from(["user:pw@", ":pw@", "query"]))
    host, tail = draw(HOSTS), draw(TAILS)
    if shape == "query":
        url = f"{scheme}://{user}@{host}{tail or '/db'}?password={written}"
    else:
        userinfo = shape.replace("user", quote(user, safe="") if encoded else user)
        url = f"{scheme}://{userinfo.replace('pw', written)}{host}{tail}"
    if draw(st.booleans()):
        url = draw(st.sampled_from(["", " ", "x", "://", "\x00"])) + url  # mangled front
    return url, token, encoded


def _everything_said(exc: BaseException) -> str:
    """An exception's message, repr, chained causes and formatted traceback."""
    return "".join(traceback.format_exception(exc)) + repr(exc)


@scaled(300)
@given(case=urls_with_a_secret(("postgresql+psycopg", "postgresql", "postgres", "mysql")))
def test_database_urls_and_their_passwords(case: tuple[str, str, bool]) -> None:
    url, token, encoded = case

    def build() -> tuple[str, str]:
        ob = outbox.Outbox(url)
        try:
            return ob.engine.url.password or "", repr(ob.engine) + str(ob.engine.url)
        finally:
            ob.close()

    outcome = attempt("database URLs", build, INPUT)
    if isinstance(outcome, BaseException):
        no_leak("URL secrets", token, _everything_said(outcome))
    else:
        password, shown = outcome
        no_leak("URL secrets", token, shown)
        if encoded and "?password=" not in url:
            assert token in password  # read back as written: nothing was misparsed
    no_leak("URL secrets", token, redact_url(url), redact(f"failed: {url} [{url}]", urls=[url]))


@scaled(200)
@given(case=urls_with_a_secret(("redis", "rediss", "unix", "http")))
def test_redis_urls_and_their_passwords(case: tuple[str, str, bool]) -> None:
    url, token, _ = case

    def build() -> object:
        ob = outbox.Outbox(
            sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:1/x"), redis_url=url
        )
        try:
            assert ob.cache is not None
            no_leak("URL secrets", token, repr(ob.cache.client))
        finally:
            ob.close()
            ob.engine.dispose()
        return check_redis_url(url)

    outcome = attempt("Redis URLs", build, INPUT)
    if isinstance(outcome, BaseException):
        no_leak("URL secrets", token, _everything_said(outcome))
    no_leak("URL secrets", token, redact_url(url))


@scaled(100)
@given(url=HOSTILE_STR_OR_NOT)
def test_any_value_as_a_url(url: Any) -> None:
    for check in (check_database_url, check_redis_url):
        attempt("URLs of any shape", lambda check=check: check(url), INPUT)
    assert isinstance(redact_url(url), str)


# ------------------------------------------------------------------------- --kafka-config

SECRET_NAMES = st.sampled_from(
    [
        "sasl.password",
        "sasl.username",
        "sasl.oauthbearer.client.secret",
        "sasl.oauthbearer.config",
        "ssl.key.password",
        "ssl.key.pem",
        "ssl.keystore.password",
        "ssl.key.location",
        "my.secret.thing",
        "some_token",
        "SASL.PASSWORD",
    ]
)


@st.composite
def kafka_config_entries(draw: st.DrawFn) -> tuple[list[str], str | None, str]:
    """``(--kafka-config items, OUTBOX_KAFKA_CONFIG, token)``: entries among which secrets
    (holding ``token``) are well formed or mangled."""
    token = draw(TOKEN)
    secret = draw(st.sampled_from([token, f"x{token}x", f"{token}=", f" {token} ", f"a,{token}"]))
    shapes = [
        f"{draw(SECRET_NAMES)}={secret}",
        f"{draw(SECRET_NAMES)}:{secret}",  # "=" forgotten: the whole item is a secret
        f"{draw(SECRET_NAMES)} {secret}",
        secret,
        f"={secret}",
        f"{draw(SECRET_NAMES)}={secret}\udcff",
        f"{draw(SECRET_NAMES)}={secret}\x01",
        f"bad name\ud800={secret}",
    ]
    items = draw(
        st.lists(
            st.one_of(st.sampled_from(shapes), st.sampled_from(["acks=all", "linger.ms=5"])),
            min_size=1,
            max_size=4,
        )
    )
    env_value = draw(st.one_of(st.none(), st.sampled_from(shapes), st.just("a=1,b=2")))
    return items, env_value, token


@scaled(300)
@given(case=kafka_config_entries())
def test_kafka_config_and_its_secrets(case: tuple[list[str], str | None, str]) -> None:
    items, env_value, token = case

    def build() -> RelayConfig:
        parsed = parse_kafka_config(items, env_value)
        config = RelayConfig(
            "postgresql+psycopg://app@db/app", "k:9092", kafka_config=parsed
        ).validate()
        producer_config(config.bootstrap_servers, config.kafka_config)
        return config

    outcome = attempt("--kafka-config", build, INPUT)
    if isinstance(outcome, BaseException):
        no_leak("Kafka secrets", token, _everything_said(outcome))
        return
    no_leak("Kafka secrets", token, repr(outcome), str(redact_kafka_config(outcome.kafka_config)))
    consumer = ConsumerConfig(["t"], "g", "k:9092", kafka_config=outcome.kafka_config)
    no_leak("Kafka secrets", token, repr(consumer))
    for name, value in outcome.kafka_config.items():
        if token in value:
            assert is_secret_setting(name)
            message = f'Invalid value "{value}" for configuration property "{name}"'
            no_leak("Kafka secrets", token, redact(message, kafka_config=outcome.kafka_config))


# ------------------------------------------------------------- the one redaction function


@scaled(200)
@given(case=urls_with_a_secret(("postgresql", "redis", "x")), noise=HOSTILE_TEXT)
def test_redaction_of_free_text(case: tuple[str, str, bool], noise: str) -> None:
    url, token, _ = case
    text = f"{noise} could not connect to {url} ({noise})"
    no_leak("redaction", token, redact(text, urls=[url]))
    no_leak("redaction", token, redact_text(f"unrecognized arguments: --databse-url {url}"))
    no_leak("redaction", token, one_line(RuntimeError(text), urls=[url]))
    config = {"sasl.password": token, "acks": "all"}
    no_leak("redaction", token, redact(f"refused sasl.password={token}", kafka_config=config))
    no_leak("redaction", token, redact_text(f"--kafka-config sasl.password={token}"))


def test_a_url_with_control_characters_is_redacted_in_one_line() -> None:
    # Found by test_redaction_of_free_text: escaping the NUL first hid the URL from its own match.
    url = "\x00postgresql://@[::1]/db?password=@@Tk123456"
    text = one_line(RuntimeError(f"could not connect to {url}"), urls=[url])
    assert "Tk123456" not in text and "\\x00" in text


def test_config_reprs_hide_secrets() -> None:
    relay = RelayConfig(
        "postgresql+psycopg://app:pw-Tk123456@db/app",
        "k:9092",
        kafka_config={"sasl.password": "Tk123456-secret", "acks": "all"},
    )
    assert "Tk123456" not in repr(relay) and "acks" in repr(relay)
    assert "Tk123456" not in repr(dataclasses.replace(relay, batch_size=7))
    consumer = ConsumerConfig(["t"], "g", kafka_config={"ssl.key.password": "Tk123456"})
    assert "Tk123456" not in repr(consumer)
