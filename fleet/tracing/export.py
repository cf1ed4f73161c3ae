"""The worker's spans, off its event loop: plain tuples in, OTLP/HTTP JSON out from a thread of their own.

A worker's spans are made after the fact, from instants it already records (``fleet.tracing.otel.Tracing.settled``).
Making them as SDK ``Span`` objects and encoding those with the SDK's protobuf encoder cost a worker about 60 us
per job under its GIL, most of an echo job's own cost. Here the worker hands each settled batch over as one tuple
of plain values (``put``: an append to a bounded queue, never a wait); the exporter's thread expands it into the
batch's spans (``spans_of``) and posts them as the OTLP specification's JSON encoding (hex trace and span ids,
int64 nanoseconds as strings, ``Content-Type: application/json``), encoded by orjson.

Configuration is the standard ``OTEL_*`` environment, read by the OpenTelemetry exporter's own resolvers so that
it means what it means for the SDK's exporter: the endpoint (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` as given, else
``OTEL_EXPORTER_OTLP_ENDPOINT`` + ``/v1/traces``), headers, timeout, compression and certificates (``_TRACES_``
variants first), and the batch processor's ``OTEL_BSP_MAX_QUEUE_SIZE`` (spans waiting; beyond it a batch's spans
are dropped and counted in ``fleet_trace_spans_dropped_total``), ``OTEL_BSP_SCHEDULE_DELAY`` (ms between exports)
and ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` (spans per request, and the queue length that wakes the thread early). The
resource (service name, ``OTEL_RESOURCE_ATTRIBUTES``) is the SDK provider's.

``SdkSpans`` hands the same spans to an SDK span processor instead (the console exporter; tests that read spans
from an in-memory exporter).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import orjson
from prometheus_client import Counter

log = logging.getLogger(__name__)

SPANS_DROPPED = Counter(
    "fleet_trace_spans_dropped_total",
    "Spans a worker dropped because its span exporter's queue (OTEL_BSP_MAX_QUEUE_SIZE) was full",
)

# OTLP's SpanKind numbers
INTERNAL, SERVER, CLIENT, PRODUCER, CONSUMER = 1, 2, 3, 4, 5
_NS = 1_000_000_000
_getrandbits = random.getrandbits
_MESSAGE_ID = "messaging.message.id"

# One settled batch as the worker hands it over (``Tracing.settled``):
#   (system, model, subject, version, jobs, batch)
# jobs: the sampled jobs, each
#   (job_id, trace_id, parent_span_id, tracestate, span_id, queued, fetched, end, state, tenant, version, batched)
#   ids as hex, instants as unix seconds (queued None: no request), batched: the job computed in the batch
# batch: None, or (fetched, started, computed, stored, count) of every job that computed (sampled or not)
Batch = tuple[str, str, str, "str | None", list[tuple[Any, ...]], "tuple[float, float, float, float, int] | None"]
# One span: (name, trace_id, span_id, parent_span_id | None, tracestate | None, kind, start_ns, end_ns, attributes,
# links: ((trace_id, span_id, job id), ...))
Span = tuple[str, str, str, "str | None", "str | None", int, int, int, dict[str, Any], Sequence[tuple[str, str, str]]]


def span_id() -> str:
    """A random, non-zero 64-bit span id as 16 hex digits."""
    return f"{_getrandbits(64) or 1:016x}"


def spans_of(batch: Batch) -> list[Span]:
    """The spans of one settled batch: per job ``queue`` and ``process``; per batch (when it computed)
    ``batch``, with ``admit``, ``compute`` and ``settle`` under it, its parent the first job's ``process`` span."""
    system, model, subject, version, jobs, computed = batch
    out: list[Span] = []
    links: list[tuple[str, str, str]] = []
    for job_id, trace_id, parent, state, sid, queued, fetched, end, job_state, tenant, job_version, batched in jobs:
        fetched_ns = int(fetched * _NS)
        if queued is not None:
            attributes = {"messaging.message.id": job_id, "fleet.model": model}
            out.append(
                (f"queue {model}", trace_id, span_id(), parent, state, INTERNAL, min(int(queued * _NS), fetched_ns),
                 fetched_ns, attributes, ())
            )  # fmt: skip
        attributes = {
            "messaging.system": system,
            "messaging.destination.name": subject,
            "messaging.operation.type": "process",
            "messaging.message.id": job_id,
            "fleet.model": model,
            "fleet.job.state": job_state,
        }
        if job_version:
            attributes["fleet.version"] = job_version
        if tenant:
            attributes["fleet.tenant"] = tenant
        out.append(
            (f"process {subject}", trace_id, sid, parent, state, CONSUMER, fetched_ns, max(fetched_ns, int(end * _NS)),
             attributes, ())
        )  # fmt: skip
        if batched:
            links.append((trace_id, sid, job_id))
    if computed is not None and links:
        fetched, started, done, stored = (int(v * _NS) for v in computed[:4])
        count = computed[4]
        trace_id, parent = links[0][0], links[0][1]
        attributes = {
            "messaging.system": system,
            "messaging.destination.name": subject,
            "messaging.operation.type": "process",
            "messaging.batch.message_count": count,
            "fleet.model": model,
            "fleet.batch.size": count,
        }
        if version:
            attributes["fleet.version"] = version
        batch_id = span_id()
        out.append(
            (f"batch {model}", trace_id, batch_id, parent, None, CONSUMER, fetched, max(fetched, stored), attributes,
             links)
        )  # fmt: skip
        inside = {"fleet.model": model}
        out.append((f"admit {model}", trace_id, span_id(), batch_id, None, INTERNAL, fetched, started, inside, ()))
        out.append((f"compute {model}", trace_id, span_id(), batch_id, None, INTERNAL, started, done, inside, ()))
        out.append((f"settle {model}", trace_id, span_id(), batch_id, None, INTERNAL, done, stored, inside, links))
    return out


def count_of(batch: Batch) -> int:
    """At most how many spans ``spans_of(batch)`` makes (two a job, four a batch): what the queue's bound counts."""
    return 2 * len(batch[4]) + (4 if batch[5] is not None else 0)


def _value(value: Any) -> dict[str, Any]:
    if value.__class__ is bool:
        return {"boolValue": value}
    if value.__class__ is int:
        return {"intValue": str(value)}
    if value.__class__ is float:
        return {"doubleValue": value}
    return {"stringValue": str(value)}


def _attributes(attributes: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{"key": key, "value": _value(value)} for key, value in attributes.items()]


def _s(value: str) -> str:
    """``value`` as a JSON string (quoted and escaped)."""
    return orjson.dumps(value).decode()


def _attr(key: str, value: str) -> str:
    return f'{{"key":"{key}","value":{{"stringValue":{_s(value)}}}}}'


def request_ends(resource: Mapping[str, Any], scope: str) -> tuple[str, str]:
    """What an ``ExportTraceServiceRequest`` in JSON holds before and after its spans."""
    head = orjson.dumps({"resource": {"attributes": _attributes(resource)}, "scopeSpans": []}).decode()
    head = head[: -len("[]}")] + f'[{{"scope":{{"name":{_s(scope)}}},"spans":['
    return '{"resourceSpans":[' + head, "]}]}]}"


def _span(
    name: str, trace_id: str, sid: str, parent: str | None, state: str, kind: int, start: int, end: int, attrs: str
) -> str:
    parent_part = f'"parentSpanId":"{parent}",' if parent is not None else ""
    return (
        f'{{"traceId":"{trace_id}","spanId":"{sid}",{parent_part}{state}"name":{name},"kind":{kind},'
        f'"startTimeUnixNano":"{start}","endTimeUnixNano":"{max(start, end)}","attributes":[{attrs}]'
    )


def encode_batch(batch: Batch) -> list[str]:
    """The JSON of each span ``spans_of(batch)`` makes (the same spans, in the same order), written straight from
    the batch's values: the OTLP JSON encoding with what every span of the batch shares encoded once."""
    system, model, subject, version, jobs, computed = batch
    out: list[str] = []
    links: list[str] = []
    queue_name, process_name = _s(f"queue {model}"), _s(f"process {subject}")
    model_attr = _attr("fleet.model", model)
    process_head = (
        f"{_attr('messaging.system', system)},{_attr('messaging.destination.name', subject)},"
        f"{_attr('messaging.operation.type', 'process')},"
    )
    for job_id, trace_id, parent, state, sid, queued, fetched, end, job_state, tenant, job_version, batched in jobs:
        fetched_ns = int(fetched * _NS)
        message_id = _attr(_MESSAGE_ID, job_id)
        state_part = f'"traceState":{_s(state)},' if state else ""
        if queued is not None:
            start = min(int(queued * _NS), fetched_ns)
            attrs = f"{message_id},{model_attr}"
            out.append(
                _span(queue_name, trace_id, span_id(), parent, state_part, INTERNAL, start, fetched_ns, attrs) + "}"
            )
        attrs = f"{process_head}{message_id},{model_attr},{_attr('fleet.job.state', job_state)}"
        if job_version:
            attrs += "," + _attr("fleet.version", job_version)
        if tenant:
            attrs += "," + _attr("fleet.tenant", tenant)
        ns = int(end * _NS)
        out.append(_span(process_name, trace_id, sid, parent, state_part, CONSUMER, fetched_ns, ns, attrs) + "}")
        if batched:
            links.append(f'{{"traceId":"{trace_id}","spanId":"{sid}","attributes":[{message_id}]}}')
    if computed is not None and links:
        fetched, started, done, stored = (int(v * _NS) for v in computed[:4])
        count = computed[4]
        first = jobs[next(i for i, job in enumerate(jobs) if job[11])]
        trace_id, parent = first[1], first[4]
        attrs = (
            f'{process_head}{{"key":"messaging.batch.message_count","value":{{"intValue":"{count}"}}}},'
            f'{model_attr},{{"key":"fleet.batch.size","value":{{"intValue":"{count}"}}}}'
        )
        if version:
            attrs += "," + _attr("fleet.version", version)
        linked = f',"links":[{",".join(links)}]}}'
        batch_id = span_id()
        out.append(
            _span(_s(f"batch {model}"), trace_id, batch_id, parent, "", CONSUMER, fetched, stored, attrs) + linked
        )
        out.append(
            _span(_s(f"admit {model}"), trace_id, span_id(), batch_id, "", INTERNAL, fetched, started, model_attr) + "}"
        )
        out.append(
            _span(_s(f"compute {model}"), trace_id, span_id(), batch_id, "", INTERNAL, started, done, model_attr) + "}"
        )
        out.append(
            _span(_s(f"settle {model}"), trace_id, span_id(), batch_id, "", INTERNAL, done, stored, model_attr) + linked
        )
    return out


class SpanSink(Protocol):
    def put(self, batch: Batch) -> None: ...
    def flush(self, timeout_s: float) -> bool: ...
    def shutdown(self) -> None: ...


class _Client(Protocol):
    def export(self, data: bytes) -> Any: ...
    def shutdown(self) -> None: ...


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        value = int(raw) if raw else default
    except ValueError:
        log.warning("%s=%r is not an integer; using %d", name, raw, default)
        return default
    return value if value > 0 else default


def client_for(endpoint: str, headers: Mapping[str, str] | None = None, timeout_s: float = 10.0) -> _Client:
    """The OpenTelemetry exporter's HTTP client (its retries and backoff) posting JSON to ``endpoint``."""
    from opentelemetry.exporter.http.transport._requests import RequestsHTTPTransport
    from opentelemetry.exporter.otlp.common.http import _OTLPHTTPClient

    return _OTLPHTTPClient(
        transport=RequestsHTTPTransport(verify=True, cert=None, session=None),
        endpoint=endpoint,
        kind="spans",
        timeout=timeout_s,
        headers={**(headers or {}), "content-type": "application/json"},
        logger=log,
    )


class JsonSpans:
    """A bounded queue of settled batches and the thread that exports their spans as OTLP/HTTP JSON."""

    def __init__(
        self,
        client: _Client,
        resource: Mapping[str, Any],
        scope: str,
        *,
        max_queue: int = 2048,
        batch_size: int = 512,
        delay_s: float = 5.0,
    ) -> None:
        self.client = client
        self._head, self._tail = request_ends(resource, scope)
        self.max_queue = max_queue
        self.batch_size = min(batch_size, max_queue)
        self.delay_s = delay_s
        self.dropped = 0
        self.exported = 0
        self.failed = 0
        self.cpu_s = 0.0  # CPU seconds the thread spent encoding and posting
        self._queue: deque[tuple[Batch, int]] = deque()
        self._queued = 0  # spans waiting in the queue
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Condition()
        self._busy = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="fleet-span-export", daemon=True)
        self._thread.start()

    @classmethod
    def from_environment(cls, resource: Mapping[str, Any], scope: str) -> JsonSpans:
        """The exporter the ``OTEL_*`` environment configures (see the module docstring)."""
        from opentelemetry.exporter.otlp.common.http import _OTLPHTTPClient
        from opentelemetry.exporter.otlp.proto.http._common import (
            _build_transport,
            _resolve_compression,
            _resolve_endpoint,
            _resolve_headers,
            _resolve_timeout,
        )
        from opentelemetry.sdk import environment_variables as ev

        headers = _resolve_headers(None, ev.OTEL_EXPORTER_OTLP_TRACES_HEADERS)
        headers["content-type"] = "application/json"
        client = _OTLPHTTPClient(
            transport=_build_transport(
                None,
                None,
                None,
                ev.OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE,
                ev.OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY,
                ev.OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE,
                session=None,
            ),
            endpoint=_resolve_endpoint(ev.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "v1/traces"),
            kind="spans",
            timeout=_resolve_timeout(ev.OTEL_EXPORTER_OTLP_TRACES_TIMEOUT),
            compression=_resolve_compression(ev.OTEL_EXPORTER_OTLP_TRACES_COMPRESSION),
            headers=headers,
            logger=log,
        )
        return cls(
            client,
            resource,
            scope,
            max_queue=_int_env("OTEL_BSP_MAX_QUEUE_SIZE", 2048),
            batch_size=_int_env("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512),
            delay_s=_int_env("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000,
        )

    def put(self, batch: Batch) -> None:
        """Queue a settled batch's spans for export; dropped (and counted) when the queue is full. Never waits."""
        n = count_of(batch)
        if self._stopping or self._queued + n > self.max_queue:
            self.dropped += n
            SPANS_DROPPED.inc(n)
            return
        with self._lock:
            self._queue.append((batch, n))
            self._queued += n
        if self._queued >= self.batch_size and not self._wake.is_set():
            self._wake.set()

    def _take(self, limit: int) -> list[str]:
        spans: list[str] = []
        queue = self._queue
        while queue and len(spans) < limit:
            with self._lock:
                batch, n = queue.popleft()
                self._queued -= n
            spans.extend(encode_batch(batch))
            # Hand the GIL back after each batch: the event loop gives it up at every socket call, and a thread that
            # held on to it would keep the loop waiting up to the switch interval (5 ms) each time.
            time.sleep(0)
        return spans

    def _export_waiting(self) -> None:
        while self._queue:
            spans = self._take(self.batch_size)
            if not spans:
                continue
            try:
                result = self.client.export(f"{self._head}{','.join(spans)}{self._tail}".encode())
                ok = getattr(result, "success", True)
            except Exception:
                log.exception("exporting %d spans failed", len(spans))
                ok = False
            if ok:
                self.exported += len(spans)
            else:
                self.failed += len(spans)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.delay_s)
            self._wake.clear()
            with self._idle:
                self._busy = True
            began = time.thread_time()
            try:
                self._export_waiting()
            finally:
                self.cpu_s += time.thread_time() - began
                with self._idle:
                    self._busy = False
                    self._idle.notify_all()
            if self._stopping and not self._queue:
                return

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Export what is queued now; whether it all went out within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._wake.set()
            with self._idle:
                if not self._queue and not self._busy:
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return not self._queue
                self._idle.wait(min(left, 0.05))

    def shutdown(self) -> None:
        """Flush, then stop the thread and the client."""
        self.flush()
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=5.0)
        self.client.shutdown()


class SdkSpans:
    """The same spans handed to an SDK span processor (``on_end``), synchronously."""

    def __init__(self, on_end: Any, resource: Any, scope: str) -> None:
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self._on_end = on_end
        self._resource = resource
        self._scope = InstrumentationScope(scope)

    def put(self, batch: Batch) -> None:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags, TraceState
        from opentelemetry.trace.status import Status

        sampled = TraceFlags(TraceFlags.SAMPLED)
        kinds = {INTERNAL: SpanKind.INTERNAL, CONSUMER: SpanKind.CONSUMER, PRODUCER: SpanKind.PRODUCER}
        remote = {job[2] for job in batch[4]}  # the spans the messages carried: the parents of queue and process
        for name, trace_id, sid, parent, state, kind, start, end, attributes, links in spans_of(batch):
            tid = int(trace_id, 16)
            ts = TraceState.from_header([state]) if state else None
            context = SpanContext(tid, int(sid, 16), False, sampled, ts)
            parent_ctx = SpanContext(tid, int(parent, 16), parent in remote, sampled, ts) if parent else None
            made = [
                Link(SpanContext(int(t, 16), int(s, 16), False, sampled), {"messaging.message.id": j})
                for t, s, j in links
            ]
            span = ReadableSpan(
                name,
                context,
                parent_ctx,
                self._resource,
                attributes,
                (),
                made,
                kinds[kind],
                None,
                Status(),
                start,
                max(start, end),
                self._scope,
            )
            self._on_end(span)

    def flush(self, timeout_s: float) -> bool:
        return True

    def shutdown(self) -> None:
        return None
