"""The console's pure parts: who is admin, how filters and ids are checked, how bytes show."""

from __future__ import annotations

import base64
import re
import uuid

import pytest
from hypothesis import given, strategies as st

from outbox.console import data
from outbox.console.app import ConsoleConfig, carries_token
from outbox.errors import ConfigurationError, InvalidKeyError, InvalidTopicError, ValidationError

TOKEN = "0123456789abcdef-token"


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_the_token_is_accepted_as_bearer_or_as_basic_password() -> None:
    assert carries_token(f"Bearer {TOKEN}", TOKEN)
    assert carries_token(basic("anyone", TOKEN), TOKEN)
    assert not carries_token(f"Bearer {TOKEN}x", TOKEN)
    assert not carries_token(basic(TOKEN, "x"), TOKEN)  # the token as user name is not enough
    assert not carries_token(f"Token {TOKEN}", TOKEN)
    assert not carries_token(None, TOKEN)


def test_without_a_token_nobody_is_admin() -> None:
    assert not carries_token("Bearer ", None)
    assert not carries_token("Bearer ", "")


@given(st.text(max_size=200))
def test_any_authorization_header_is_a_yes_or_no_never_an_error(header: str) -> None:
    accepted = carries_token(header, TOKEN)
    assert isinstance(accepted, bool)
    assert not accepted or TOKEN in header or header.strip().lower().startswith("basic")


def test_a_short_admin_token_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="at least 16"):
        ConsoleConfig("postgresql+psycopg://u@h/db", admin_token="short").validate()


@given(st.text(max_size=30))
def test_an_offset_is_a_whole_number_in_range_or_a_validation_error(value: str) -> None:
    try:
        offset = data.parse_offset(value)
    except ValidationError as exc:
        assert "offset" in str(exc)
    else:
        assert 0 <= offset <= data.MAX_OFFSET


def test_bad_filters_are_refused_before_any_query() -> None:
    with pytest.raises(InvalidTopicError):
        data.parse_filter({"topic": "not a topic"})
    with pytest.raises(ValidationError, match="NUL"):
        data.parse_filter({"error": "a\x00b"})
    with pytest.raises(ValidationError, match="at most"):
        data.parse_filter({"key": "k" * (data.MAX_FILTER_LENGTH + 1)})
    with pytest.raises(InvalidKeyError):
        data.parse_key_lookup({"scope": "bad scope", "key": "k"})
    with pytest.raises(ValidationError, match="both"):
        data.parse_key_lookup({"scope": "orders"})
    where = data.parse_filter({"topic": "orders", "key": "k1", "error": "", "other": "x"})
    assert where == data.ParkedFilter(topic="orders", key=b"k1", error=None)


@given(st.lists(st.text(max_size=40), max_size=5))
def test_event_ids_are_uuids_or_a_validation_error(values: list[str]) -> None:
    try:
        ids = data.parse_event_ids(values)
    except ValidationError as exc:
        assert "not a UUID" in str(exc)
    else:
        assert [str(i) for i in ids] == [str(uuid.UUID(v)) for v in values]


def test_values_show_as_json_text_hex_or_null() -> None:
    assert data.show_bytes(b'{"a":1}').kind == "json"
    assert data.show_bytes(b'{"a":1}').text == '{\n  "a": 1\n}'
    assert data.show_bytes(b"plain <b>").kind == "text"
    shown = data.show_bytes(b"\x00\xff")
    assert (shown.kind, shown.text) == ("hex", "00 ff")
    assert data.show_bytes(None).kind == "null"
    cut = data.show_bytes(b"x" * 100, size=10_000)
    assert cut.cut and cut.size == 10_000


def test_secret_headers_are_hidden() -> None:
    shown = dict(
        data.show_headers(
            {
                "sasl.password": "p",
                "Authorization": "Bearer t",
                "trace": "1",
                "b": {"base64": "AP8="},
            }
        )
    )
    assert shown == {"sasl.password": "***", "Authorization": "***", "trace": "1", "b": "00 ff"}


def test_a_warning_links_a_command_that_has_a_page_and_sets_other_commands_as_code() -> None:
    html = str(data.warning_html("1 parked row holds back later rows: see `outbox parked list`"))
    assert html == '1 parked row holds back later rows: see <a href="/parked">the Parked page</a>'
    assert "`" not in str(data.warning_html("schema behind: run `outbox migrate`"))
    assert "<code>outbox migrate</code>" in str(data.warning_html("run `outbox migrate`"))


@given(st.text(max_size=200))
def test_a_warning_never_lets_markup_through(text: str) -> None:
    html = str(data.warning_html(text))
    assert "<" not in re.sub(r'</?code>|<a href="/parked">|</a>', "", html)


def test_the_pending_rows_are_counted_in_the_request_while_that_is_quick() -> None:
    plan = data.pending_count_plan
    # no count yet, or one for another lane count: count now, whatever it costs
    assert plan(None, 16, 0.0, 0.0, 0.05, False) == (True, False)
    assert plan(8, 16, 9.0, 1.0, 0.05, False) == (True, False)
    # the last count was within the budget: count now again
    assert plan(16, 16, 0.05, 1.0, 0.05, False) == (True, False)
    # too slow: show the last count; recount in the background once it is old enough
    assert plan(16, 16, 0.3, 4.9, 0.05, False) == (False, False)
    assert plan(16, 16, 0.3, 5.0, 0.05, False) == (False, True)
    assert plan(16, 16, 0.3, 5.0, 0.05, True) == (False, False)  # one is already running
    # a count that takes 2 s runs at most a tenth of the time
    assert plan(16, 16, 2.0, 19.9, 0.05, False) == (False, False)
    assert plan(16, 16, 2.0, 20.0, 0.05, False) == (False, True)


def test_the_earlier_name_of_the_consoles_config_still_imports() -> None:
    from outbox.console.app import ConsoleConfig, ConsoleSettings

    assert ConsoleSettings is ConsoleConfig
