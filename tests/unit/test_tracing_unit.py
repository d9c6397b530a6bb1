"""Tracing without services: the trace_context setting (field, variable, flag), stored contexts,
and the trace headers an event gets."""

from __future__ import annotations

import json

import pytest

from outbox._core import codec
from outbox._core.events import encode_event
from outbox._otel import spans
from outbox.cli import build_parser
from outbox.cli.consume import config_from_args
from outbox.config import ConsumerConfig
from outbox.errors import ConfigurationError

BASE = {"topics": ["orders"], "group": "billing", "bootstrap_servers": "k:9092"}
PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_trace_context_is_parent_by_default_and_link_on_request() -> None:
    assert ConsumerConfig(**BASE).validate().trace_context == "parent"
    assert ConsumerConfig(**BASE, trace_context="link").validate().trace_context == "link"


@pytest.mark.parametrize("bad", ["child", "", "LINK", None, 1])
def test_an_unknown_trace_context_is_refused(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="trace_context must be one of parent, link"):
        ConsumerConfig(**BASE, trace_context=bad).validate()  # type: ignore[arg-type]


def _consume_args(*extra: str) -> list[str]:
    return ["consume", "app:handle", "--topic", "orders", "--group", "billing",
            "--database-url", "postgresql+psycopg://u@h/db", "--bootstrap-servers", "k:9092",
            *extra]  # fmt: skip


def test_the_flag_and_its_variable_set_the_trace_context(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = _consume_args()
    assert config_from_args(build_parser(argv).parse_args(argv)).trace_context == "parent"
    monkeypatch.setenv("OUTBOX_CONSUMER_TRACE_CONTEXT", "link")
    assert config_from_args(build_parser(argv).parse_args(argv)).trace_context == "link"
    argv = _consume_args("--trace-context", "parent")  # the flag wins over the variable
    assert config_from_args(build_parser(argv).parse_args(argv)).trace_context == "parent"


def test_a_bad_variable_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_CONSUMER_TRACE_CONTEXT", "sibling")
    argv = _consume_args()
    with pytest.raises(ConfigurationError, match="OUTBOX_CONSUMER_TRACE_CONTEXT"):
        config_from_args(build_parser(argv).parse_args(argv))


def test_help_names_the_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser(["consume", "--help"]).parse_args(["consume", "--help"])
    out = capsys.readouterr().out
    assert "--trace-context" in out and "OUTBOX_CONSUMER_TRACE_CONTEXT" in out


def test_an_event_gets_the_trace_headers_unless_the_publisher_set_a_traceparent() -> None:
    context = {"traceparent": PARENT, "tracestate": "k=v"}
    event = encode_event("t", {"a": 1}, None, {"source": "api"}, 1 << 20, context)
    assert json.loads(event.headers_json) == {
        "source": "api", "content-type": "application/json", **context,
    }  # fmt: skip
    own = encode_event("t", {"a": 1}, None, {"TraceParent": "mine"}, 1 << 20, context)
    assert json.loads(own.headers_json) == {
        "TraceParent": "mine", "content-type": "application/json",
    }  # fmt: skip


def test_stored_contexts_are_read_from_the_row_headers() -> None:
    assert spans is not None
    plain = json.dumps({"traceparent": PARENT})
    context = spans.stored_context(plain)
    assert context is not None
    assert (context.trace_id, context.span_id) == (
        0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331,
    )  # fmt: skip
    as_bytes = json.dumps(codec.encode_headers({"traceparent": PARENT.encode()}))
    assert spans.stored_context(as_bytes) == context
    assert spans.stored_context(json.dumps({"source": "api"})) is None
    assert spans.stored_context(json.dumps({"traceparent": "00-garbage"})) is None
    assert spans.stored_context('{"traceparent": {"base64": "!!"}}') is None


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


def _recorded() -> tuple[object, object]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_a_failure_is_recorded_as_one_redacted_line_and_never_raises() -> None:
    from opentelemetry.trace import StatusCode

    provider, exporter = _recorded()
    tracer = provider.get_tracer("test")  # type: ignore[attr-defined]
    span = tracer.start_span("s")
    secret = "postgresql://app:hunter2@db/app"
    spans.failed(span, RuntimeError(f"cannot reach {secret}\n[parameters: ('card-4242',)]"))
    spans.failed(span, _Unprintable())  # its __str__ raises: recorded without its text
    span.end()
    (finished,) = exporter.get_finished_spans()  # type: ignore[attr-defined]
    assert finished.status.status_code is StatusCode.ERROR
    texts = [finished.status.description or ""] + [
        str(v)
        for e in finished.events
        for k, v in e.attributes.items()
        if k != "exception.stacktrace"
    ]
    assert all("hunter2" not in t and "card-4242" not in t for t in texts)
    assert [e.attributes["exception.type"] for e in finished.events] == [
        "RuntimeError",
        "_Unprintable",
    ]


@pytest.mark.parametrize(
    "stored",
    [
        '{"traceparent": ' + "[" * 5000 + "]" * 5000 + "}",  # nesting past the recursion limit
        '{"traceparent": "00-zz"}',
        '[["traceparent", {"b64": "%%%"}]]',
        "traceparent",
    ],
)
def test_a_stored_context_of_any_shape_is_no_context(stored: str) -> None:
    assert spans.stored_context(stored) is None


def test_a_dead_letter_describes_an_exception_whose_text_cannot_be_read() -> None:
    from outbox._core.deadletter import DeadLetter, Reason

    letter = DeadLetter.from_exception(Reason.PERMANENT_ERROR, _Unprintable(), 1)
    assert letter.error.startswith("_Unprintable: ")


def test_a_request_span_continues_the_incoming_trace_and_a_5xx_is_an_error() -> None:
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, StatusCode

    provider, exporter = _recorded()
    tracer = provider.get_tracer("outbox")  # type: ignore[attr-defined]
    saved = spans._tracer
    spans._tracer = tracer
    try:
        for status in (201, 503):
            with spans.request("POST", "/orders", {"traceparent": PARENT}) as span:
                assert span is not None and trace.get_current_span() is span
                spans.responded(span, status)
        with spans.request("POST", "/orders", {}) as span:  # nothing to continue: no span
            assert span is None
    finally:
        spans._tracer = saved
    ok, failed = exporter.get_finished_spans()  # type: ignore[attr-defined]
    for finished in (ok, failed):
        assert finished.kind is SpanKind.SERVER
        assert format(finished.context.trace_id, "032x") == PARENT.split("-")[1]
        assert format(finished.parent.span_id, "016x") == PARENT.split("-")[2]
    assert ok.status.status_code is StatusCode.UNSET
    assert ok.attributes["http.response.status_code"] == 201
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes["error.type"] == "503"
