"""The worker's span exporter (``fleet.tracing.export``) against a real HTTP receiver in this process: what it posts
is the OTLP JSON encoding of exactly the spans ``spans_of`` makes (the SDK path's), to the endpoint and with the
headers the ``OTEL_*`` environment names; a full queue drops and counts instead of waiting; stopping flushes."""

from __future__ import annotations

import http.server
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from prometheus_client import REGISTRY

from fleet.tracing.export import (
    CONSUMER,
    INTERNAL,
    Batch,
    JsonSpans,
    client_for,
    count_of,
    encode_batch,
    request_ends,
    span_id,
    spans_of,
)


class Receiver:
    """An OTLP/HTTP receiver that keeps each request (path, headers, body); ``hold`` makes it wait before
    answering."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.hold = threading.Event()
        self.hold.set()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.hold.wait(10)
                outer.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                return None

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list[dict[str, Any]]:
        return [
            span
            for _, _, body in self.requests
            for rs in orjson.loads(body)["resourceSpans"]
            for ss in rs["scopeSpans"]
            for span in ss["spans"]
        ]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.hold.set()
    r.server.shutdown()
    r.server.server_close()


def batch_of(n: int, *, state: str | None = None, tenant: str | None = "acme") -> Batch:
    now = time.time()
    jobs = [
        (
            f'job-{i}-"quoted"',
            uuid.uuid4().hex,
            uuid.uuid4().hex[:16],
            state,
            span_id(),
            now - 0.5 if i else None,  # the first: no request (no queue span)
            now - 0.4,
            now - 0.1,
            "succeeded",
            tenant,
            "v2",
            i % 3 != 2,  # every third did not compute in the batch
        )
        for i in range(n)
    ]
    return ("nats", "echo", "fleet.req.echo", "v2", jobs, (now - 0.4, now - 0.3, now - 0.2, now - 0.1, n))


def as_json(span: tuple[Any, ...]) -> dict[str, Any]:
    """What the OTLP JSON encoding of a ``spans_of`` span is."""
    name, trace_id, sid, parent, state, kind, start, end, attributes, links = span
    encoded: dict[str, Any] = {"traceId": trace_id, "spanId": sid}
    if parent is not None:
        encoded["parentSpanId"] = parent
    if state:
        encoded["traceState"] = state
    encoded |= {
        "name": name,
        "kind": kind,
        "startTimeUnixNano": str(start),
        "endTimeUnixNano": str(max(start, end)),
        "attributes": [
            {"key": k, "value": {"intValue": str(v)} if isinstance(v, int) else {"stringValue": v}}
            for k, v in attributes.items()
        ],
    }
    if links:
        encoded["links"] = [
            {"traceId": t, "spanId": s, "attributes": [{"key": "messaging.message.id", "value": {"stringValue": j}}]}
            for t, s, j in links
        ]
    return encoded


def test_the_json_is_the_otlp_encoding_of_the_spans_the_sdk_path_makes() -> None:
    batch = batch_of(5, state="vendor=a b")
    made = spans_of(batch)
    assert count_of(batch) >= len(made) == 4 + 5 + 4  # 4 queue spans (one job had no request), 5 process, 4 batch
    encoded = [orjson.loads(s) for s in encode_batch(batch)]
    # span ids made in the thread are random: compare everything else, and the tree they make
    for mine, theirs in zip(encoded, made, strict=True):
        want = as_json(theirs)
        if theirs[0].startswith(("queue", "batch", "admit", "compute", "settle")):
            want["spanId"] = mine["spanId"]
            if theirs[0].startswith(("admit", "compute", "settle")):
                want["parentSpanId"] = mine["parentSpanId"]
        assert mine == want
    by_name = {s["name"]: s for s in encoded}
    batch_span = by_name["batch echo"]
    assert batch_span["kind"] == CONSUMER and by_name["compute echo"]["kind"] == INTERNAL
    assert by_name["compute echo"]["parentSpanId"] == batch_span["spanId"]
    process = [s for s in encoded if s["name"] == "process fleet.req.echo"]
    assert batch_span["parentSpanId"] == process[0]["spanId"]  # the first batched job's process span
    assert [link["spanId"] for link in batch_span["links"]] == [
        p["spanId"] for i, p in enumerate(process) if i % 3 != 2
    ]
    head, tail = request_ends({"service.name": "svc", "deployment.environment": "t"}, "fleet")
    whole = orjson.loads(f"{head}{','.join(encode_batch(batch))}{tail}")
    (resource_spans,) = whole["resourceSpans"]
    assert {"key": "service.name", "value": {"stringValue": "svc"}} in resource_spans["resource"]["attributes"]
    assert resource_spans["scopeSpans"][0]["scope"] == {"name": "fleet"}


def test_the_environment_names_the_endpoint_headers_and_batches(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # the traces variable wins
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"{receiver.url}/custom/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20abc,x-tenant=acme")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "20")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")  # only the batch size (or a flush) sends
    spans = JsonSpans.from_environment({"service.name": "worker-x"}, "fleet")
    try:
        for _ in range(4):
            spans.put(batch_of(3))  # 3 jobs: 2 queue + 3 process + 4 batch = 9 spans, counted as 10
        deadline = time.monotonic() + 10
        while not receiver.requests and time.monotonic() < deadline:  # the batch size woke the thread
            time.sleep(0.01)
        assert receiver.requests, "the thread did not export when the queue reached the batch size"
        assert spans.flush(10)
    finally:
        spans.shutdown()
    assert {path for path, _, _ in receiver.requests} == {"/custom/traces"}
    for _, headers, _ in receiver.requests:
        assert headers["content-type"] == "application/json"
        assert headers["authorization"] == "Bearer abc" and headers["x-tenant"] == "acme"
    assert len(receiver.spans()) == 4 * 9 == spans.exported and spans.dropped == 0


def test_a_full_queue_drops_and_counts_without_waiting_and_stopping_flushes(receiver: Receiver) -> None:
    receiver.hold.clear()  # the receiver stalls: the thread's first export waits on it
    spans = JsonSpans(client_for(f"{receiver.url}/v1/traces"), {}, "fleet", max_queue=40, batch_size=10)
    dropped_before = REGISTRY.get_sample_value("fleet_trace_spans_dropped_total") or 0.0
    started = time.monotonic()
    for _ in range(30):
        spans.put(batch_of(3))
    assert time.monotonic() - started < 0.5  # no put waited for the stalled export
    assert spans.dropped > 0
    assert REGISTRY.get_sample_value("fleet_trace_spans_dropped_total") == dropped_before + spans.dropped
    receiver.hold.set()
    spans.shutdown()  # flushes what was queued
    assert spans.exported == len(receiver.spans()) > 0
    assert spans.exported + spans.dropped >= 30 * 9  # every span either went out or was counted as dropped
    spans.put(batch_of(1))  # after shutdown: dropped, counted, never queued
    assert spans.exported == len(receiver.spans())
