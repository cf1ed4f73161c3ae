"""The OpenTelemetry side of Fleet's traces: the SDK pipeline and every span Fleet makes. Imported only when tracing
is on (``fleet.tracing.state.start``).

Pipeline: the SDK's ``TracerProvider`` (its sampler from ``OTEL_TRACES_SAMPLER`` / ``_ARG``, parent-based by default;
its resource from ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``), a ``BatchSpanProcessor`` and the OTLP/HTTP
exporter (its endpoint from ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``). Spans follow
OpenTelemetry's messaging conventions (``messaging.system``, ``messaging.destination.name``,
``messaging.operation.type``, ``messaging.message.id`` = the job id) plus ``fleet.model``, ``fleet.version``,
``fleet.tenant`` and ``fleet.batch.size``.

Spans of one job (its trace, parent: the context its message carries):

* ``<method> <route>`` (SERVER, the gateway's request, ``fleet.producers.gateway.tracing_middleware``; a client's
  ``traceparent`` header is its parent) and ``publish <subject>`` (PRODUCER: its context is what goes on the wire);
* at the worker, made after the fact from the instants the worker records (``Job.fetched_at`` ...), handed as
  plain tuples to ``fleet.tracing.export`` (with OTLP: a thread that posts them as OTLP/HTTP JSON, no SDK span
  object and no protobuf encoder on the worker's path): ``queue <model>`` (the request's ``submitted_at`` to the
  fetch) and ``process <subject>`` (CONSUMER, fetch to stored);
* ``batch <model>`` (one span per batch, the batch-receiving pattern: a link to each job's context; its parent is
  the first traced job's ``process`` span, so that job's trace shows it), with ``admit <model>`` (fetch to the
  batch's start), ``compute <model>`` and ``settle <model>`` under it;
* for a DAG run, one trace: ``run <dag>`` at its start, and ``hop <dag>`` under the ``process`` span of the step
  that launched the next ones, whose ``publish`` spans it parents.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from fleet.constants import HEADER_TRACEPARENT, HEADER_TRACESTATE
from fleet.tracing.export import JsonSpans, SdkSpans, SpanSink, span_id
from fleet.tracing.wire import carried

_PROPAGATOR = TraceContextTextMapPropagator()
_CONSUMER = SpanKind.CONSUMER
SCOPE = "fleet"


def span_context(traceparent: str, tracestate: str | None = None) -> SpanContext:
    """The remote ``SpanContext`` of a valid ``traceparent`` (``fleet.tracing.wire.valid``)."""
    state = TraceState.from_header([tracestate]) if tracestate else None
    return SpanContext(
        trace_id=int(traceparent[3:35], 16),
        span_id=int(traceparent[36:52], 16),
        is_remote=True,
        trace_flags=TraceFlags(int(traceparent[53:55], 16) & 0x01),
        trace_state=state,
    )


def traceparent_of(ctx: SpanContext) -> str:
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def _parent(ctx: SpanContext | None) -> otel_context.Context | None:
    return trace.set_span_in_context(NonRecordingSpan(ctx)) if ctx is not None else None


def _exporter(kind: str) -> SpanExporter:
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


class Tracing:
    """The process's tracer and the spans Fleet makes (see the module docstring)."""

    def __init__(self, provider: TracerProvider, spans: SpanSink | None = None) -> None:
        """``spans``: where the worker's after-the-fact spans go (default: the provider's span processor, in this
        thread; ``from_environment`` gives an OTLP exporter a ``JsonSpans`` of its own)."""
        self.provider = provider
        self.tracer = provider.get_tracer(SCOPE)
        self._sampler = provider.sampler
        self._parent_based = isinstance(provider.sampler, ParentBased)
        self.spans: SpanSink = spans or SdkSpans(provider._active_span_processor.on_end, provider.resource, SCOPE)

    @classmethod
    def from_environment(cls, service: str, kind: str) -> Tracing:
        """The SDK pipeline as the ``OTEL_*`` variables say; ``service`` when ``OTEL_SERVICE_NAME`` names none.
        With the OTLP exporter the worker's spans take the JSON exporter (``fleet.tracing.export.JsonSpans``)."""
        resource = Resource.create({"service.name": service}).merge(OTELResourceDetector().detect())
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(_exporter(kind)))
        spans = JsonSpans.from_environment(dict(resource.attributes), SCOPE) if kind == "otlp" else None
        return cls(provider, spans)

    def flush(self, timeout_s: float = 5.0) -> None:
        self.spans.flush(timeout_s)
        self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        self.spans.shutdown()
        self.provider.shutdown()

    # -- the current context ---------------------------------------------------------------------------------
    @staticmethod
    def current_traceparent() -> str | None:
        """The current span's ``traceparent`` (None: no span is current)."""
        ctx = trace.get_current_span().get_span_context()
        return traceparent_of(ctx) if ctx.is_valid else None

    @staticmethod
    def current_trace_id() -> str | None:
        ctx = trace.get_current_span().get_span_context()
        return f"{ctx.trace_id:032x}" if ctx.is_valid else None

    @contextmanager
    def span(
        self,
        name: str,
        attributes: Mapping[str, Any] | None = None,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        parent: str | SpanContext | None = None,
    ) -> Iterator[trace.Span]:
        """A span current for the block: a child of ``parent`` (a ``traceparent`` or a context) when given, else
        of the current span."""
        ctx = span_context(parent) if isinstance(parent, str) else parent
        with self.tracer.start_as_current_span(name, context=_parent(ctx), kind=kind, attributes=attributes) as s:
            yield s

    @contextmanager
    def resumed(self, traceparent: str | None) -> Iterator[None]:
        """Make the remote context ``traceparent`` current for the block (None: change nothing)."""
        if traceparent is None:
            yield
            return
        token = otel_context.attach(_parent(span_context(traceparent)) or otel_context.Context())
        try:
            yield
        finally:
            otel_context.detach(token)

    @contextmanager
    def server(self, method: str, route: str, headers: Mapping[str, str]) -> Iterator[trace.Span]:
        """The SERVER span of a REST request, child of the client's ``traceparent`` header when it sends one."""
        found = carried(headers, None)
        parent = span_context(*found) if found else None
        attributes = {"http.request.method": method, "http.route": route}
        with self.span(f"{method} {route}", attributes, kind=SpanKind.SERVER, parent=parent) as s:
            yield s

    @contextmanager
    def publish(
        self, system: str, subject: str, job_id: str, model: str, headers: dict[str, str], **fleet: Any
    ) -> Iterator[None]:
        """A PRODUCER span around a publish; its context is written into ``headers`` (``traceparent``,
        ``tracestate``) for the message to carry."""
        attributes = {
            "messaging.system": system,
            "messaging.destination.name": subject,
            "messaging.operation.type": "publish",
            "messaging.message.id": job_id,
            "fleet.model": model,
            **{f"fleet.{k}": v for k, v in fleet.items() if v is not None},
        }
        with self.tracer.start_as_current_span(f"publish {subject}", kind=SpanKind.PRODUCER, attributes=attributes):
            _PROPAGATOR.inject(headers)
            yield

    # -- the worker: spans made after the fact ----------------------------------------------------------------
    @staticmethod
    def trace_id_of(job: Any) -> str | None:
        """The trace id (32 hex) of a delivered job's trace, or None; the first call keeps what its message carries
        in ``job.trace`` (``(traceparent, tracestate)``: no OpenTelemetry object until a span is made of it)."""
        trace = job.trace
        if trace is None:
            trace = job.trace = carried(job.delivery.headers, job.request)
            if trace is None:
                return None
        if trace.__class__ is tuple:
            return str(trace[0][3:35])
        return f"{trace.trace_id:032x}"

    @staticmethod
    def job_context(job: Any) -> SpanContext | None:
        """The context a delivered job's message carries (header, else body field), or None."""
        found = carried(job.delivery.headers, job.request)
        return span_context(*found) if found is not None else None

    def _sampled(self, parent: SpanContext | None, trace_id: int, name: str, kind: SpanKind) -> bool:
        """The sampler's decision for a span of ``parent`` (None: a new trace). A parent-based sampler (the
        default) follows a remote parent's flag without being asked, as it would decide."""
        if parent is not None and self._parent_based:
            return parent.trace_flags.sampled
        context = _parent(parent)
        return self._sampler.should_sample(context, trace_id, name, kind).decision.is_sampled()

    def settled(self, system: str, model: str, items: Sequence[tuple[Any, Any]]) -> None:
        """The spans of settled jobs (``(Job, terminal record)`` pairs, ``Job.trace`` their incoming context or
        None), from the instants on the jobs and records, handed to the span sink as one tuple of plain values
        (``fleet.tracing.export``: its thread makes and exports the spans). Each sampled job's ``trace`` becomes
        its ``process`` span's context (the parent of a DAG hop); per job: ``queue`` and ``process``; per batch:
        ``batch``, ``admit``, ``compute`` and ``settle``."""
        jobs: list[tuple[Any, ...]] = []
        computed: list[tuple[Any, Any]] = []
        batched = False
        parent_based = self._parent_based
        for job, record in items:
            in_batch = job.batch_started_at is not None and job.computed_at is not None
            if in_batch:
                computed.append((job, record))
            found = job.trace  # (traceparent, tracestate) as the message carried it (``trace_id_of``), or None
            if found.__class__ is not tuple or job.fetched_at is None:
                continue
            traceparent = found[0]
            if parent_based:
                if not int(traceparent[54], 16) & 1:  # not sampled upstream: nothing to make
                    continue
            else:
                remote = span_context(*found)
                if not self._sampled(remote, remote.trace_id, job.delivery.subject, _CONSUMER):
                    continue
            timings = record.timings
            stored = timings.stored if timings is not None else None
            request = job.request
            sid = span_id()
            trace_hex = traceparent[3:35]
            jobs.append(
                (
                    job.job_id or "",
                    trace_hex,
                    traceparent[36:52],
                    found[1],
                    sid,
                    request.submitted_at if request is not None else None,
                    job.fetched_at,
                    stored if stored is not None else record.finished_at or job.fetched_at,
                    record.state.value,
                    record.tenant,
                    record.version,
                    in_batch,
                )
            )
            batched = batched or in_batch
            job.trace = (f"00-{trace_hex}-{sid}-01", found[1])
        if not jobs:
            return
        batch = None
        if batched:  # a batch without a sampled job makes no spans (it would be a trace alone)
            batch = (
                min(job.fetched_at or job.batch_started_at for job, _ in computed),
                min(job.batch_started_at for job, _ in computed),
                max(job.computed_at for job, _ in computed),
                max(
                    r.timings.stored if r.timings is not None and r.timings.stored else job.computed_at
                    for job, r in computed
                ),
                len(computed),
            )
        subject = items[0][0].delivery.subject
        version = computed[0][1].version if computed else None
        self.spans.put((system, model, subject, version, jobs, batch))

    @staticmethod
    def parent_of(job: Any, fallback: str | None) -> SpanContext | None:
        """The parent for what a settled job leads to (a DAG hop): its ``process`` span, else ``fallback`` (a
        ``traceparent``, e.g. the run's root)."""
        ctx = getattr(job, "trace", None)
        if isinstance(ctx, SpanContext):
            return ctx
        if isinstance(ctx, tuple):  # not sampled, or made no span: the context it carried
            return span_context(*ctx)
        return span_context(fallback) if fallback else None


def inject(headers: dict[str, str]) -> None:
    """Write the current context into ``headers`` (what ``Tracing.publish`` does inside its span)."""
    _PROPAGATOR.inject(headers)


__all__ = ["HEADER_TRACEPARENT", "HEADER_TRACESTATE", "Tracing", "inject", "span_context", "traceparent_of"]
