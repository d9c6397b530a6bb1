"""The HTTP door's pure decisions: key parsing, admission, fingerprints, which responses are
stored, their encoding and the problem documents."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from outbox._core import http, http_answers
from outbox._core.http import (
    Headers,
    Request,
    decode_response,
    encode_response,
    fingerprint,
    is_stored,
    parse_key,
)
from outbox._core.http_admission import (
    HttpConfig,
)
from outbox._core.http_answers import (
    Refused,
    problem_for,
)
from outbox._core.validate import check_key
from outbox.errors import ConfigurationError, KeyInProgress, KeyReuseError, PreviouslyFailed


def refusal(values: list[str]) -> http_answers.Problem:
    with pytest.raises(Refused) as caught:
        parse_key(values)
    return caught.value.problem


# -- the key --------------------------------------------------------------------------------


def test_bare_value_is_the_key_as_sent() -> None:
    assert parse_key(["8e03978e-40d5-43e8-bc93-6894a57f9324"]) == (
        "8e03978e-40d5-43e8-bc93-6894a57f9324"
    )
    assert parse_key(["order 42/a"]) == "order 42/a"
    assert parse_key(["  padded\t"]) == "padded"  # optional whitespace is not the value's


def test_structured_field_string_is_unquoted() -> None:
    assert parse_key(['"8e03978e-40d5"']) == "8e03978e-40d5"
    assert parse_key([r'"say \"hi\" \\ bye"']) == 'say "hi" \\ bye'


def test_utf8_bare_value_is_decoded() -> None:
    sent = "clé-✓".encode().decode("latin-1")  # how a server hands the bytes over
    assert parse_key([sent]) == "clé-✓"


def test_absent_key_is_none() -> None:
    assert parse_key([]) is None


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ([""], "empty"),
        (['""'], "empty"),
        (["k" * 256], "256 characters"),
        (['"' + "k" * 256 + '"'], "256 characters"),
        (["a", "b"], "2 Idempotency-Key fields"),
        (['"open'], "no closing"),
        (['"a"b'], "after the structured-field string"),
        (['"a";p=1'], "parameters"),
        ([r'"a\n"'], "may only escape"),
        (['"é"'], "printable ASCII"),
        (["a\x01b"], "control"),
        (["\xff\xfe"], "UTF-8"),
    ],
)
def test_bad_keys_are_400(values: list[str], says: str) -> None:
    problem = refusal(values)
    assert problem.status == 400
    assert problem.slug == "idempotency-key-invalid"
    assert says in problem.detail


def test_key_of_255_characters_is_accepted() -> None:
    assert parse_key(["k" * 255]) == "k" * 255


@settings(max_examples=500, deadline=None)
@given(st.lists(st.text(), max_size=3))
def test_any_header_value_gives_a_valid_key_or_a_400(values: list[str]) -> None:
    try:
        key = parse_key(values)
    except Refused as refused:
        assert refused.problem.status == 400
        return
    if key is not None:
        assert check_key(key) == key


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_header_bytes_give_a_valid_key_or_a_400(raw: bytes) -> None:
    try:
        key = parse_key([raw.decode("latin-1")])
    except Refused as refused:
        assert refused.problem.status == 400
        return
    assert key is not None and check_key(key) == key


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1))
def test_structured_string_round_trips(key: str) -> None:
    quoted = '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if len(key) <= 255:
        assert parse_key([quoted]) == key
    else:
        assert refusal([quoted]).status == 400


# -- admission ------------------------------------------------------------------------------


def request(method: str = "POST", key: str | None = "k1", **headers: str) -> Request:
    pairs = [(name.replace("_", "-"), value) for name, value in headers.items()]
    if key is not None:
        pairs.append(("Idempotency-Key", key))
    return Request(method, "/orders", Headers(pairs))


def test_methods_not_covered_pass_through_with_or_without_a_key() -> None:
    admission = HttpConfig(require_key=True).admission()
    for method in ("GET", "HEAD", "OPTIONS", "PUT", "DELETE"):
        assert admission.admit(request(method)) is None
        assert admission.admit(request(method, key=None)) is None


def test_missing_key_passes_unless_required() -> None:
    assert HttpConfig().admission().admit(request(key=None)) is None
    with pytest.raises(Refused) as caught:
        HttpConfig(require_key=True).admission().admit(request(key=None))
    assert caught.value.problem.status == 400
    assert caught.value.problem.slug == "idempotency-key-missing"


def test_default_scope_and_fixed_scope() -> None:
    covered = HttpConfig().admission().admit(request("PATCH"))
    assert covered is not None and (covered.scope, covered.key) == ("http", "k1")
    covered = HttpConfig(scope="orders.v2").admission().admit(request())
    assert covered is not None and covered.scope == "orders.v2"


def test_scope_callable_sees_the_request_with_case_insensitive_headers() -> None:
    seen: list[Request] = []

    def tenant(req: Request) -> str:
        seen.append(req)
        return "tenant:" + req.headers["x-tenant"]

    covered = HttpConfig(scope=tenant).admission().admit(request(X_TENANT="acme"))
    assert covered is not None and covered.scope == "tenant:acme"
    assert seen[0].method == "POST" and seen[0].path == "/orders"
    assert seen[0].headers["X-TENANT"] == "acme" and "x-Tenant" in seen[0].headers


def test_invalid_scope_from_the_request_is_400() -> None:
    admission = HttpConfig(scope=lambda req: req.headers.get("x-tenant", "")).admission()
    with pytest.raises(Refused) as caught:
        admission.admit(request(X_TENANT="no spaces allowed"))
    assert caught.value.problem.status == 400
    assert caught.value.problem.slug == "idempotency-scope-invalid"


def test_a_scope_callable_that_raises_is_400_not_500() -> None:
    admission = HttpConfig(scope=lambda req: req.headers["x-tenant"]).admission()
    with pytest.raises(Refused) as caught:
        admission.admit(request())  # no X-Tenant: the callable raises KeyError
    assert caught.value.problem.status == 400
    assert caught.value.problem.slug == "idempotency-scope-invalid"
    assert caught.value.problem.detail == (
        "the request has no 'x-tenant' header, which this endpoint's idempotency scope is "
        "made of: send it"
    )


def test_a_scope_callable_failing_otherwise_names_its_error() -> None:
    admission = HttpConfig(scope=lambda req: {}["tenant"]).admission()
    with pytest.raises(Refused) as caught:
        admission.admit(request())
    assert caught.value.problem.status == 400
    assert "(KeyError)" in caught.value.problem.detail


@pytest.mark.parametrize(
    "options",
    [
        {"scope": "bad scope"},
        {"scope": 42},
        {"methods": "POST"},
        {"methods": ()},
        {"methods": ("PO ST",)},
        {"max_request_bytes": 0},
        {"max_response_bytes": -1},
        {"retry_after": True},
        {"stored_headers": "location"},
    ],
)
def test_bad_settings_are_refused(options: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        HttpConfig(**options).admission()  # type: ignore[arg-type]


def test_declared_length_over_the_limit_is_413() -> None:
    admission = HttpConfig(max_request_bytes=10).admission()
    admission.check_declared_length("10")
    admission.check_declared_length(None)
    admission.check_declared_length("nonsense")
    with pytest.raises(Refused) as caught:
        admission.check_declared_length("11")
    assert caught.value.problem.status == 413


def test_headers_mapping() -> None:
    headers = Headers([("Link", "<a>"), ("link", "<b>"), ("X-A", "1")])
    assert headers["LINK"] == "<a>, <b>"
    assert headers.getall("link") == ["<a>", "<b>"]
    assert headers.getall("missing") == []
    assert len(headers) == 2 and set(headers) == {"link", "x-a"}
    assert 3 not in headers


# -- fingerprint ----------------------------------------------------------------------------


def test_fingerprint_covers_method_target_and_body() -> None:
    base = fingerprint("POST", "/orders", b'{"a":1}')
    assert base == fingerprint("POST", "/orders", b'{"a":1}')
    assert base.startswith("sha256:") and len(base) == 71
    others = {
        fingerprint("PATCH", "/orders", b'{"a":1}'),
        fingerprint("POST", "/orders/", b'{"a":1}'),
        fingerprint("POST", "/orders?x=1", b'{"a":1}'),
        fingerprint("POST", "/orders", b'{"a":2}'),
        # no ambiguity between where the path ends and the body begins
        fingerprint("POST", "/orders\x00", b'{"a":1}'),
    }
    assert base not in others and len(others) == 5


def _target(raw_path: str, query: str = "") -> str:
    return Request("POST", "(decoded)", Headers([]), query, raw_path).target


def test_the_target_keeps_apart_what_decoding_merges() -> None:
    targets = [
        _target("/transfer%3Famount=1"),
        _target("/transfer", "amount=1"),
        _target("/a%2Fb"),
        _target("/a/b"),
        _target("/x%FF"),
        _target("/x%FE"),
        _target("/x", "5:y"),  # a query that looks like a length prefix
        _target("/x5:y"),
    ]
    assert len(set(targets)) == len(targets)


@given(st.text(max_size=20), st.text(max_size=20), st.text(max_size=20), st.text(max_size=20))
def test_path_and_query_are_length_prefixed_apart(p1: str, q1: str, p2: str, q2: str) -> None:
    assert (_target(p1, q1) == _target(p2, q2)) == ((p1, q1) == (p2, q2))


def test_without_a_raw_path_the_decoded_one_is_encoded_again() -> None:
    request = Request("POST", "/transfer?amount=1", Headers([]))
    assert request.target == http.request_target("/transfer%3Famount%3D1", "")


def test_methods_are_admitted_whatever_their_case() -> None:
    admission = HttpConfig(require_key=True).admission()
    for method in ("post", "Post", "pAtCh"):
        with pytest.raises(Refused):
            admission.admit(Request(method, "/pay", Headers([])))
    covered = admission.admit(Request("pAtCh", "/pay", Headers([("Idempotency-Key", "k")])))
    assert covered is not None and covered.key == "k"


# -- responses ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "stored"),
    [
        (200, True), (201, True), (204, True), (303, True),
        (400, True), (404, True), (410, True), (422, True),
        (401, False), (403, False), (408, False), (409, False), (423, False), (425, False),
        (429, False), (500, False), (502, False), (503, False), (504, False), (101, False),
    ],
)  # fmt: skip
def test_which_statuses_are_stored(status: int, stored: bool) -> None:
    assert is_stored(status) is stored


STORED = http.DEFAULT_STORED_HEADERS


@settings(max_examples=300, deadline=None)
@given(
    status=st.integers(100, 599),
    body=st.binary(max_size=200) | st.text(max_size=200).map(str.encode),
)
def test_stored_response_round_trips_byte_for_byte(status: int, body: bytes) -> None:
    headers = [("Content-Type", "application/json"), ("Location", "/orders/1")]
    result = encode_response(status, headers, body, STORED)
    # the result goes through JSON (jsonb, Redis) before it is read back
    decoded = decode_response(json.loads(json.dumps(result)))
    assert decoded.status == status and decoded.body == body
    assert decoded.headers == [("content-type", "application/json"), ("location", "/orders/1")]
    assert "\\u0000" not in json.dumps(result)  # jsonb would refuse it


def test_text_body_is_stored_as_text_binary_as_base64() -> None:
    text = encode_response(201, [], '{"id":1,"name":"café"}'.encode(), STORED)
    assert text["encoding"] == "utf-8" and text["body"] == '{"id":1,"name":"café"}'
    nul = encode_response(200, [], b"a\x00b", STORED)
    assert nul["encoding"] == "base64"
    binary = encode_response(200, [], b"\xff\xd8\xff", STORED)
    assert binary["encoding"] == "base64"


def test_only_the_documented_headers_are_stored_in_order() -> None:
    headers = [
        ("Content-Type", "text/plain"),
        ("Set-Cookie", "session=secret"),
        ("Date", "Tue, 24 Nov 2026 00:00:00 GMT"),
        ("Link", "<a>"),
        ("Content-Length", "3"),
        ("Link", "<b>"),
        ("X-Order", "7"),
    ]
    result = encode_response(200, headers, b"abc", STORED)
    assert result["headers"] == [["content-type", "text/plain"], ["link", "<a>"], ["link", "<b>"]]
    extended = encode_response(200, headers, b"abc", STORED | {"x-order"})
    assert ["x-order", "7"] in extended["headers"]


def test_replay_headers_add_length_and_mark() -> None:
    response = decode_response(encode_response(201, [("content-type", "a/b")], b"abcd", STORED))
    assert http.replay_headers(response) == [
        ("content-type", "a/b"),
        ("content-length", "4"),
        ("idempotent-replayed", "true"),
    ]


@pytest.mark.parametrize(
    "result",
    [
        None,
        "done",
        {"order": 1},
        {"status": 200, "headers": [], "body": "x"},
        {"status": 99, "headers": [], "body": "x", "encoding": "utf-8"},
        {"status": 200, "headers": [["a"]], "body": "x", "encoding": "utf-8"},
        {"status": 200, "headers": [], "body": "not base64!", "encoding": "base64"},
    ],
)
def test_a_result_of_another_door_is_a_500_problem(result: object) -> None:
    with pytest.raises(Refused) as caught:
        decode_response(result)
    assert caught.value.problem.status == 500


def test_streaming_is_more_than_one_piece_without_a_length() -> None:
    assert not http.is_streaming(1, [])
    assert http.is_streaming(2, [("content-type", "text/plain")])
    assert not http.is_streaming(2, [("Content-Length", "10")])


# -- problems -------------------------------------------------------------------------------


def test_problem_documents_follow_rfc_9457() -> None:
    problem = problem_for(KeyInProgress("http", "k"), retry_after=2)
    assert problem is not None
    response = problem.response()
    assert response.status == 409
    headers = dict(response.headers)
    assert headers["content-type"] == "application/problem+json"
    assert headers["retry-after"] == "2"
    assert int(headers["content-length"]) == len(response.body)
    document = json.loads(response.body)
    assert set(document) == {"type", "title", "status", "detail"}
    assert document["status"] == 409
    assert document["type"] == http_answers.PROBLEM_TYPE_BASE + "idempotency-key-in-progress"

    reused = problem_for(KeyReuseError("http", "k"), 1)
    failed = problem_for(PreviouslyFailed("http", "k", "boom"), 1)
    assert reused is not None and reused.status == 422
    assert failed is not None and failed.status == 422 and failed.slug != reused.slug
    assert problem_for(ConfigurationError("x"), 1) is None


def test_status_line() -> None:
    assert http.status_line(201) == "201 Created"
    assert http.status_line(599) == "599 Unknown"


def test_the_middlewares_import_no_web_framework() -> None:
    code = (
        "import sys, outbox, outbox.http, outbox.http.asgi, outbox.http.wsgi\n"
        "web = {'starlette', 'fastapi', 'flask', 'werkzeug', 'uvicorn', 'gunicorn', 'httpx'}\n"
        "print(sorted(web & {name.split('.')[0] for name in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
