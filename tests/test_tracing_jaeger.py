"""Traces across every hop, read back from a real Jaeger (``jaeger`` fixture: v1.75.0, OTLP over HTTP).

A gateway and a worker run in this process on NATS + Redis with the ``OTEL_*`` environment pointing at Jaeger.
A DAG run of two steps started over REST is ONE trace holding, for each step, the publish, queue, process, admit,
batch, compute and settle spans, the hop from the first step to the second, and the REST request's SERVER span at
its root; a job submitted over REST with a client's ``traceparent`` joins the client's trace, and its record
names the trace (``trace_id``) and carries its stage timings.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY

from fleet import constants as c
from fleet import tracing
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.worker import Worker
from fleet.dags.runner import DagRunner
from fleet.store.bundle import Stores
from tests.gateway_helpers import WORKER_SETTINGS, echo_sleep_gateway
from tests.jaeger_service import Jaeger

pytestmark = pytest.mark.services

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


@pytest.fixture
def traced(jaeger: Jaeger, unique: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Tracing on for this test (this process's spans go to Jaeger under a service name of its own)."""
    service = f"fleet-test-{unique}"
    tracing.shutdown()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", jaeger.otlp_endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", service)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_on")
    try:
        yield service
    finally:
        tracing.shutdown()


async def jaeger_trace(jaeger: Jaeger, trace_id: str, wanted: set[str], timeout_s: float = 20) -> list[dict[str, Any]]:
    """The spans of ``trace_id`` once every name in ``wanted`` is among them (Jaeger ingests in batches: polled)."""
    deadline = time.monotonic() + timeout_s
    names: set[str] = set()
    async with httpx.AsyncClient(timeout=5) as http:
        while time.monotonic() < deadline:
            tracing.flush()
            answer = await http.get(f"{jaeger.query_url}/api/traces/{trace_id}")
            if answer.status_code == 200:
                data = answer.json()["data"]
                spans = [span for trace in data for span in trace["spans"]]
                names = {span["operationName"] for span in spans}
                if wanted <= names:
                    return spans
            await asyncio.sleep(0.2)
    raise AssertionError(f"trace {trace_id} in Jaeger lacks {sorted(wanted - names)}; it has {sorted(names)}")


def tag(span: dict[str, Any], key: str) -> Any:
    return next((t["value"] for t in span["tags"] if t["key"] == key), None)


def parent_of(span: dict[str, Any]) -> str | None:
    return next((r["spanID"] for r in span["references"] if r["refType"] == "CHILD_OF"), None)


class Served:
    def __init__(self, gateway: Any, worker: Worker) -> None:
        self.gateway, self.worker = gateway, worker


@contextlib.asynccontextmanager
async def serve(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[Served]:
    async with echo_sleep_gateway(request, "nats+redis", unique) as gateway:
        handler = with_name(EchoHandler, gateway.echo)
        runner = DagRunner(gateway.broker, gateway.store, Stores.beside(gateway.store).dags)
        worker = Worker(
            handler(),
            gateway.broker,
            gateway.store,
            settings=WORKER_SETTINGS,
            max_wait_ms=2,
            on_settled=[runner.on_settled],
        )
        async with worker:
            yield Served(gateway, worker)


async def test_a_dag_run_through_nats_and_redis_is_one_trace_with_every_hop(
    request: pytest.FixtureRequest, unique: str, traced: str, jaeger: Jaeger
) -> None:
    async with serve(request, unique) as served:
        gw = served.gateway
        spec = {
            "name": f"traced-{unique}",
            "steps": [
                {"id": "a", "model": gw.echo, "input": {"text": "${input.text}"}},
                {"id": "b", "model": gw.echo, "input": {"text": "${steps.a.output.text}"}},
            ],
            "output": "${steps.b.output}",
        }
        async with gw.http() as http:
            assert (await http.post("/v1/dags", json=spec)).status_code == 201, "register"
            started = await http.post(f"/v1/dags/{spec['name']}/runs", json={"input": {"text": "hi"}})
            assert started.status_code == 202, started.text
            run_id = started.json()["run_id"]
            run = (await http.get(f"/v1/runs/{run_id}")).json()
            for _ in range(200):
                if run["state"] != "running":
                    break
                await asyncio.sleep(0.05)
                run = (await http.get(f"/v1/runs/{run_id}")).json()
            assert run["state"] == "succeeded", run
            job_ids = [job for step in ("a", "b") for job in run["steps"][step]["job_ids"]]
            records = [(await http.get(f"/v1/jobs/{job_id}")).json() for job_id in job_ids]
        hops = REGISTRY.get_sample_value("fleet_job_stage_seconds_count", {"model": gw.echo, "stage": "hop"})
        assert hops == 1  # step a's record written to step b published: the one hop of the run
        trace_ids = {record["trace_id"] for record in records}
        assert len(trace_ids) == 1 and None not in trace_ids, records  # both steps: one trace
        (trace_id,) = trace_ids
        for record in records:  # every step's record has its stage timings too
            timings = record["timings"]
            assert timings["queued"] <= timings["fetched"] <= timings["batch_started"] <= timings["computed"]
            assert timings["computed"] <= timings["stored"]
        subject = c.request_subject(gw.echo)
        per_step = {
            f"publish {subject}",
            f"queue {gw.echo}",
            f"process {subject}",
            f"admit {gw.echo}",
            f"batch {gw.echo}",
            f"compute {gw.echo}",
            f"settle {gw.echo}",
        }
        wanted = {"POST /v1/dags/{name}/runs", f"run {spec['name']}", f"hop {spec['name']}", *per_step}
        spans = await jaeger_trace(jaeger, trace_id, wanted)
        assert {span["traceID"] for span in spans} == {trace_id}
        for name in per_step:  # each step has its own: two of each
            assert sum(span["operationName"] == name for span in spans) == 2, name
        by_id = {span["spanID"]: span for span in spans}
        root = next(s for s in spans if s["operationName"] == "POST /v1/dags/{name}/runs")
        assert parent_of(root) is None and tag(root, "span.kind") == "server"
        hop = next(s for s in spans if s["operationName"] == f"hop {spec['name']}")
        hop_parent = by_id[parent_of(hop)]  # the hop hangs under step a's process span...
        assert hop_parent["operationName"] == f"process {subject}"
        assert tag(hop_parent, "messaging.message.id") == job_ids[0]
        publishes = [s for s in spans if s["operationName"] == f"publish {subject}"]
        assert {tag(s, "messaging.message.id") for s in publishes} == set(job_ids)
        second = next(s for s in publishes if tag(s, "messaging.message.id") == job_ids[1])
        assert parent_of(second) == hop["spanID"]  # ...and parents the publish of step b
        for span in publishes:
            assert tag(span, "span.kind") == "producer" and tag(span, "messaging.system") == "nats"
        batch = next(s for s in spans if s["operationName"] == f"batch {gw.echo}")
        assert tag(batch, "fleet.batch.size") == 1 and tag(batch, "messaging.operation.type") == "process"
        assert any(ref["refType"] == "FOLLOWS_FROM" for ref in batch["references"])  # the link to its job
        compute = next(s for s in spans if s["operationName"] == f"compute {gw.echo}")
        assert by_id[parent_of(compute)]["operationName"] == f"batch {gw.echo}"


async def test_a_job_submitted_with_a_client_traceparent_joins_the_clients_trace(
    request: pytest.FixtureRequest, unique: str, traced: str, jaeger: Jaeger
) -> None:
    async with serve(request, unique) as served:
        gw = served.gateway
        async with gw.http() as http:
            answer = await http.post(
                "/v1/jobs",
                json={"model": gw.echo, "input": {"text": "traced"}},
                headers={"traceparent": CLIENT_PARENT, "tracestate": "vendor=1"},
            )
            assert answer.status_code == 202, answer.text
            job_id = answer.json()["job_id"]
            record = (await http.get(f"/v1/jobs/{job_id}", params={"wait": 10})).json()
        assert record["state"] == "succeeded" and record["trace_id"] == CLIENT_TRACE
        subject = c.request_subject(gw.echo)
        wanted = {"POST /v1/jobs", f"publish {subject}", f"process {subject}", f"batch {gw.echo}"}
        spans = await jaeger_trace(jaeger, CLIENT_TRACE, wanted)
        server = next(s for s in spans if s["operationName"] == "POST /v1/jobs")
        assert parent_of(server) == "00f067aa0ba902b7"  # the client's span
        assert tag(server, "http.response.status_code") == 202
        publish = next(s for s in spans if s["operationName"] == f"publish {subject}")
        assert parent_of(publish) == server["spanID"]
        process = next(s for s in spans if s["operationName"] == f"process {subject}")
        assert parent_of(process) == publish["spanID"]  # the context on the wire is the publish span's
        assert tag(process, "messaging.message.id") == job_id and tag(process, "span.kind") == "consumer"
