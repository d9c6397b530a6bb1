"""The HTTP door tells callers apart: what the fingerprint covers of the caller."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, strategies as st

from outbox._core.http import (
    Headers,
    Request,
    fingerprint,
)
from outbox._core.http_admission import (
    HttpConfig,
    cookies_of,
)
from outbox.errors import ConfigurationError


def request(*pairs: tuple[str, str]) -> Request:
    return Request("POST", "/orders", Headers(pairs))


def test_the_default_covers_the_authorization_header() -> None:
    admission = HttpConfig().admission()
    alice = admission.caller_of(request(("Authorization", "Bearer alice")))
    mallory = admission.caller_of(request(("authorization", "Bearer mallory")))
    assert alice is not None and mallory is not None and alice != mallory
    assert "alice" not in alice  # a digest, never the credential
    assert admission.caller_of(request(("Authorization", "Bearer alice"))) == alice
    assert admission.caller_of(request(("X-Other", "x"))) is None  # anonymous
    prints = {fingerprint("POST", "/orders", b"{}", c) for c in (alice, mallory, None)}
    assert len(prints) == 3


def test_without_a_caller_the_fingerprint_is_the_earlier_one() -> None:
    # Keys stored before callers were covered keep matching their anonymous retries.
    assert fingerprint("POST", "/o", b"x", None) == fingerprint("POST", "/o", b"x")


def test_named_cookies_and_headers() -> None:
    admission = HttpConfig(caller_headers=("X-Api-Key",), caller_cookies=("session",)).admission()
    base = admission.caller_of(request(("Cookie", "theme=dark; session=s1"), ("x-api-key", "k")))
    assert base is not None
    # Other cookies and Authorization are not looked at.
    same = request(
        ("Cookie", "session=s1; theme=light"), ("X-Api-Key", "k"), ("Authorization", "z")
    )
    assert admission.caller_of(same) == base
    assert admission.caller_of(request(("Cookie", "session=s2"), ("x-api-key", "k"))) != base
    assert admission.caller_of(request(("Cookie", "theme=dark"))) is None


def test_a_principal_decides_alone() -> None:
    def principal(req: Request) -> str | None:
        token = req.headers.get("authorization")
        return None if token is None else token.rsplit(".", 1)[0]  # the account, not the token

    admission = HttpConfig(principal=principal).admission()
    one = admission.caller_of(request(("Authorization", "acct-7.token-a")))
    assert one is not None
    assert admission.caller_of(request(("Authorization", "acct-7.token-b"))) == one
    assert admission.caller_of(request(("Authorization", "acct-8.token-a"))) != one
    assert admission.caller_of(request()) is None
    wrong = HttpConfig(principal=lambda req: 7).admission()  # type: ignore[arg-type,return-value]
    with pytest.raises(ConfigurationError, match="must return a str"):
        wrong.caller_of(request())


def test_per_caller_off_shares_responses_among_callers() -> None:
    admission = HttpConfig(per_caller=False).admission()
    assert admission.caller_of(request(("Authorization", "Bearer alice"))) is None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"per_caller": "yes"}, "per_caller must be a bool"),
        ({"principal": "user"}, "principal must be a callable"),
        ({"per_caller": False, "principal": lambda r: "u"}, "cannot go with a principal"),
        ({"caller_headers": "authorization"}, "caller_headers is a collection"),
        ({"caller_cookies": [""]}, "caller_cookies is a collection"),
        ({"caller_headers": None}, "caller_headers is a collection"),
        ({"caller_headers": ()}, "nothing tells callers apart"),
    ],
)
def test_bad_caller_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        HttpConfig(**settings).admission()


def test_cookie_fields_are_parsed_leniently() -> None:
    assert cookies_of(["a=1; b=2", "a=3;junk; =x; c="]) == {"a": ["1", "3"], "b": ["2"], "c": [""]}


@given(
    a=st.lists(st.tuples(st.sampled_from(["authorization", "x"]), st.text(max_size=8)), max_size=3),
    b=st.lists(st.tuples(st.sampled_from(["authorization", "x"]), st.text(max_size=8)), max_size=3),
)
def test_callers_with_other_credentials_never_share_a_fingerprint(
    a: list[tuple[str, str]], b: list[tuple[str, str]]
) -> None:
    admission = HttpConfig().admission()
    creds_a = [v for n, v in a if n == "authorization"]
    creds_b = [v for n, v in b if n == "authorization"]
    same = admission.caller_of(request(*a)) == admission.caller_of(request(*b))
    assert same == (creds_a == creds_b)
