"""Trace context on the wire, on every broker: a raw producer's body field, a header that wins over it, a message
with neither; the batch span's links; the record's ``trace_id``; exemplars in the OpenMetrics exposition; the
``OTEL_*`` variables Fleet reads, and their refusals; the SDK's caller context (real brokers, an in-process
worker, spans caught by the SDK's in-memory exporter)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from prometheus_client import REGISTRY
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics

from fleet import constants as c
from fleet import tracing
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.stages import StageHistograms
from fleet.consumers.worker import Worker
from fleet.errors import ConfigError
from fleet.schemas.jobs import JobState, StageTimings
from fleet.store import transitions
from fleet.tracing import wire
from fleet.tracing.caller import trace_headers
from fleet.tracing.config import exporter
from fleet.tracing.otel import Tracing
from tests.dag_fixtures import urls_for
from tests.infra import connected_pair, request_bytes, settings_for, wait_terminal

BODY = "00-11111111111111111111111111111111-2222222222222222-01"
HEADER = "00-33333333333333333333333333333333-4444444444444444-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    previous = tracing.use(Tracing(provider))
    try:
        yield exporter
    finally:
        tracing.use(previous)
        tracing.shutdown()


@pytest.mark.services
@pytest.mark.parametrize("pair", ["memory", "nats", "kafka"])
async def test_the_header_wins_the_body_field_serves_raw_producers_and_the_batch_links_each_job(
    request: pytest.FixtureRequest, pair: str, unique: str, spans: InMemorySpanExporter
) -> None:
    settings = settings_for(pair, urls_for(request, pair))
    handler = with_name(EchoHandler, f"wire-{unique}")
    model = handler.spec.name
    subject = c.request_subject(model)
    ids = {name: f"w-{unique}-{name}" for name in ("body", "both", "none")}
    async with connected_pair(settings) as (broker, store):
        await broker.ensure_model(model)
        await broker.publish(subject, request_bytes(model, ids["body"], {"t": 1}, traceparent=BODY), msg_id=ids["body"])
        await broker.publish(
            subject,
            request_bytes(model, ids["both"], {"t": 2}, traceparent=BODY),
            msg_id=ids["both"],
            headers={c.HEADER_TRACEPARENT: HEADER, c.HEADER_TRACESTATE: "k=v"},
        )
        await broker.publish(subject, request_bytes(model, ids["none"], {"t": 3}), msg_id=ids["none"])
        async with Worker(handler(), broker, store, settings=settings, max_batch=8, max_wait_ms=200):
            records = await wait_terminal(store, list(ids.values()))
    assert records[ids["body"]].trace_id == wire.trace_id(BODY)
    assert records[ids["both"]].trace_id == wire.trace_id(HEADER)  # the header wins
    assert records[ids["none"]].trace_id is None
    finished = spans.get_finished_spans()
    process = {s.attributes["messaging.message.id"]: s for s in finished if s.name == f"process {subject}"}
    assert set(process) == {ids["body"], ids["both"]}  # an untraced job has no spans of its own
    both = process[ids["both"]]
    assert both.parent is not None and f"{both.parent.span_id:016x}" == "4444444444444444"
    assert both.attributes["messaging.system"] == pair and both.kind is trace.SpanKind.CONSUMER
    assert both.parent.trace_state.get("k") == "v"
    batches = [s for s in finished if s.name == f"batch {model}"]
    linked = {f"{link.context.trace_id:032x}" for s in batches for link in s.links}
    assert linked == {wire.trace_id(BODY), wire.trace_id(HEADER)}  # one link per traced job of the batch
    assert all(s.attributes["fleet.batch.size"] >= len(s.links) for s in batches)
    for s in finished:  # explicit instants: never a span that ends before it starts
        assert s.start_time is not None and s.end_time is not None and s.start_time <= s.end_time, s.name
    # the stage histograms name the trace of a traced job's bucket (OpenMetrics exposition only)
    text = openmetrics(REGISTRY).decode()
    stage = [line for line in text.splitlines() if f'model="{model}",stage="queue"' in line and "# {" in line]
    assert any(wire.trace_id(HEADER) in line or wire.trace_id(BODY) in line for line in stage), stage


def test_a_traceparent_that_is_not_w3c_counts_as_absent() -> None:
    class Request:
        traceparent, tracestate = BODY, "a=1"

    assert wire.carried({c.HEADER_TRACEPARENT: HEADER}, Request) == (HEADER, None)
    assert wire.carried({c.HEADER_TRACEPARENT: "garbage"}, Request) == (BODY, "a=1")
    for bad in (
        "00-" + "0" * 32 + "-4444444444444444-01",  # no trace
        "00-33333333333333333333333333333333-" + "0" * 16 + "-01",  # no span
        "ff-33333333333333333333333333333333-4444444444444444-01",  # the forbidden version
        "00-3333333333333333333333333333333X-4444444444444444-01",
        HEADER + "-extra",
    ):
        assert not wire.valid(bad), bad
        assert wire.carried({c.HEADER_TRACEPARENT: bad}, None) is None
    assert wire.carried({c.HEADER_TRACEPARENT: HEADER, c.HEADER_TRACESTATE: "x" * 600}, None) == (HEADER, None)


def test_the_otel_environment_turns_tracing_on_and_refuses_what_fleet_does_not_ship() -> None:
    assert exporter({}) is None  # off by default
    assert exporter({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}) == "otlp"
    assert exporter({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://h:4318/v1/traces"}) == "otlp"
    assert exporter({"OTEL_TRACES_EXPORTER": "console"}) == "console"
    assert exporter({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4318"}) is None
    assert exporter({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}) is None
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER='zipkin'"):
        exporter({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_PROTOCOL='grpc'"):
        exporter({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})


def test_the_sdk_sends_the_callers_current_span_and_nothing_without_one() -> None:
    assert trace_headers() == {}
    ctx = SpanContext(int("3" * 32, 16), int("4" * 16, 16), is_remote=False, trace_flags=TraceFlags(1))
    with trace.use_span(NonRecordingSpan(ctx)):
        assert trace_headers() == {c.HEADER_TRACEPARENT: HEADER}


async def test_metrics_answer_openmetrics_with_exemplars_to_a_scraper_that_asks(unique: str) -> None:
    from tests.gateway_helpers import asgi_gateway
    from tests.infra import settings_for

    StageHistograms(f"om-{unique}").observe(
        [
            transitions.finished(
                None,
                "j",
                JobState.succeeded,
                model="m",
                output=None,
                error=None,
                worker_id=None,
                now=3.0,
                timings=StageTimings(queued=1.0, fetched=2.0),
                trace_id=wire.trace_id(HEADER),
            )
        ]
    )
    async with asgi_gateway(settings_for("memory", {})) as (_, http):
        plain = await http.get("/metrics")
        open_metrics = await http.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert plain.headers["content-type"].startswith("text/plain") and "# {" not in plain.text
    assert open_metrics.headers["content-type"].startswith("application/openmetrics-text")
    assert open_metrics.text.rstrip().endswith("# EOF")
    line = next(x for x in open_metrics.text.splitlines() if f'model="om-{unique}",stage="queue"' in x and "# {" in x)
    assert f'trace_id="{wire.trace_id(HEADER)}"' in line
