"""The fleet's pure decisions: who serves which database, what a databases file lists."""

from __future__ import annotations

from typing import Any

import pytest

from outbox._core.fleet import (
    assignment,
    check_member_id,
    member_key,
    member_namespace,
    owner_namespace,
    owner_of,
    parse_databases_file,
)
from outbox.config import FleetConfig, RelayConfig
from outbox.errors import ConfigurationError

DATABASES = [f"127.0.0.1:5432/tenant_{i}" for i in range(300)]


def test_member_key_is_stable_and_31_bits() -> None:
    assert member_key("relay-a") == member_key("relay-a")
    assert member_key("relay-a") != member_key("relay-b")
    assert all(0 <= member_key(f"m{i}") < 2**31 for i in range(1000))


def test_namespaces_differ_from_each_other_and_by_schema() -> None:
    assert member_namespace(None) != owner_namespace(None)
    assert member_namespace(None) != member_namespace("tenant")


def test_no_member_no_owner() -> None:
    assert owner_of("db", []) is None


def test_every_database_has_one_owner_among_the_members() -> None:
    members = [member_key(m) for m in ("a", "b", "c")]
    owners = assignment(DATABASES, members)
    assert set(owners.values()) <= set(members)
    # Roughly even: each of three members gets between a fifth and a half.
    for m in members:
        share = sum(1 for o in owners.values() if o == m)
        assert len(DATABASES) / 5 < share < len(DATABASES) / 2


def test_order_of_members_does_not_matter() -> None:
    members = [member_key(m) for m in ("a", "b", "c")]
    assert assignment(DATABASES, members) == assignment(DATABASES, list(reversed(members)))


def test_a_member_leaving_moves_only_its_own_databases_and_back() -> None:
    a, b, c = (member_key(m) for m in ("a", "b", "c"))
    before = assignment(DATABASES, [a, b, c])
    during = assignment(DATABASES, [b, c])
    after = assignment(DATABASES, [a, b, c])
    moved = {d for d in DATABASES if before[d] != during[d]}
    assert moved == {d for d in DATABASES if before[d] == a}
    assert after == before


def test_a_rolling_restart_moves_each_database_at_most_twice() -> None:
    names = ["a", "b", "c"]
    keys = {n: member_key(n) for n in names}
    moves = dict.fromkeys(DATABASES, 0)
    current = assignment(DATABASES, keys.values())
    for restarting in names:
        for alive in ([k for n, k in keys.items() if n != restarting], list(keys.values())):
            nxt = assignment(DATABASES, alive)
            for d in DATABASES:
                moves[d] += current[d] != nxt[d]
            current = nxt
    assert max(moves.values()) <= 2
    assert sum(moves.values()) > 0


def test_databases_file_lines() -> None:
    text = "# tenants\n\n  postgresql://h/a  \npostgresql://h/b\npostgresql://h/a\n#x\n"
    assert parse_databases_file(text) == ["postgresql://h/a", "postgresql://h/b"]
    assert parse_databases_file("") == []


@pytest.mark.parametrize("bad", ["", "x" * 201, "a\nb", "tab\there"])
def test_bad_member_ids_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="member id"):
        check_member_id(bad)


def test_good_member_id() -> None:
    assert check_member_id("relay-0.pod") == "relay-0.pod"


RELAY = RelayConfig("postgresql+psycopg://u@h/db", "127.0.0.1:9092")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({}, "no database to serve"),
        ({"discover_url": "postgresql://u@h/postgres"}, "go together"),
        ({"discover_pattern": "t%"}, "go together"),
        ({"database_urls": ("mysql://h/x",)}, "database URL|URL"),
        ({"database_urls": ("postgresql://u@h/a",), "member_id": ""}, "--member-id"),
        ({"database_urls": ("postgresql://u@h/a",), "refresh_interval": 0}, "--refresh-interval"),
    ],
)
def test_bad_fleet_settings_are_refused(changes: dict[str, Any], message: str) -> None:
    settings: dict[str, Any] = {"relay": RELAY, "member_id": "m", **changes}
    with pytest.raises(ConfigurationError, match=message):
        FleetConfig(**settings).validate()


def test_fleet_settings_hide_passwords_and_name_the_membership_database() -> None:
    config = FleetConfig(
        RELAY, database_urls=("postgresql://u:secret@h/a", "postgresql://u@h/b"), member_id="m"
    ).validate()
    assert "secret" not in repr(config)
    assert config.membership_database() == "postgresql://u:secret@h/a"
