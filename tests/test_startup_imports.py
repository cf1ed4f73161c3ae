"""Start-up in a second: imports follow use.

``fleet --help`` and ``import fleet.cli`` import no server code and not even the settings; a worker for ``echo``
imports neither the gateway, FastAPI, uvicorn, FAISS, Kubernetes, the autoscaler nor torch. Checked in fresh
interpreters (a module imported by an earlier test would hide one), and once in a real ``fleet worker`` process
through ``PYTHONPROFILEIMPORTTIME``, which lists every module the process imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import ROOT, fleet_env, fleet_process, stop, wait_http_ready
from tests.services import free_port

SERVER = (
    "torch",
    "transformers",
    "fastapi",
    "starlette",
    "uvicorn",
    "faiss",
    "kubernetes",
    "fleet.producers.gateway",
    "fleet.autoscaler",
    "fleet.cli.serving",
)
WORKER_ONLY = ("numpy", "redis", "nats", "aiokafka", "prometheus_client")  # the worker extra's, and redis
CLI = (*SERVER, *WORKER_ONLY, "fleet.settings", "pydantic_settings", "pydantic")


def imported_after(code: str, modules: tuple[str, ...]) -> set[str]:
    """Run ``code`` in a fresh interpreter; which of ``modules`` it imported."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {modules!r} if m in sys.modules]))"
    result = subprocess.run(
        [sys.executable, "-c", probe], env=fleet_env(), capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


HELP = """
import contextlib, io, sys
sys.argv = ["fleet", "--help"]
from fleet.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
    main()
assert "Usage" in out.getvalue(), out.getvalue()
"""


def test_import_fleet_cli_and_fleet_help_import_no_server_code_and_no_settings() -> None:
    assert imported_after("import fleet.cli", CLI) == set()
    assert imported_after(HELP, CLI) == set()


def test_the_client_sdk_imports_no_server_code_no_broker_client_and_no_numpy() -> None:
    assert imported_after("from fleet import FleetClient, FleetSyncClient", (*SERVER, *WORKER_ONLY)) == set()


WORKER = """
import fleet.cli
from fleet.brokers.nats import NatsBroker
from fleet.cli.compose import build_worker, run_worker
from fleet.settings import FleetSettings
from fleet.store.memory import MemoryStore
settings = FleetSettings(broker_url="nats://127.0.0.1:1", models="echo")
worker = build_worker("echo", NatsBroker.from_settings(settings), MemoryStore(job_ttl_s=60), settings)
worker.handler.load()
worker.handler.warmup()
"""


def test_building_an_echo_worker_imports_no_gateway_fastapi_faiss_kubernetes_autoscaler_or_torch() -> None:
    assert imported_after(WORKER, SERVER) == set()


# What Fleet's tracing would import: the tracing SDK, the exporter, the W3C propagator. (Not ``opentelemetry`` itself:
# redis-py 7 imports OpenTelemetry's metrics API for its own observability whenever the package is installed.)
OTEL = (
    "fleet.tracing.otel",
    "opentelemetry.sdk.trace",
    "opentelemetry.sdk.trace.export",
    "opentelemetry.exporter.otlp.proto.http",
    "opentelemetry.trace.propagation.tracecontext",
)
RUNNING_ECHO = """
import asyncio
from fleet import tracing
from fleet.brokers import make_broker
from fleet.cli.compose import build_worker
from fleet.settings import FleetSettings
from fleet.store.memory import MemoryStore
from tests.infra import publish_requests, wait_terminal

async def main():
    settings = FleetSettings(broker_url="memory://", models="echo")
    broker, store = make_broker(settings), MemoryStore(job_ttl_s=60)
    await broker.connect()
    async with build_worker("echo", broker, store, settings):
        ids = await publish_requests(broker, "echo", [{"text": "a"}], "off")
        record = (await wait_terminal(store, ids))[ids[0]]
    assert record.timings is not None and record.trace_id is None and tracing.active() is None

asyncio.run(main())
"""


def test_a_worker_with_tracing_off_imports_no_tracing_sdk_exporter_or_propagator() -> None:
    """No ``OTEL_*`` exporter or endpoint: a worker that ran a job (timings recorded) imported none of it."""
    assert imported_after(RUNNING_ECHO, OTEL) == set()
    assert imported_after("from fleet.tracing import otel", OTEL) == set(OTEL) - {
        "opentelemetry.exporter.otlp.proto.http"
    }


def test_the_gateway_side_does_import_them() -> None:
    """The probe sees what it looks for: the module that serves the gateway imports FastAPI and the autoscaler."""
    assert {"fastapi", "uvicorn", "fleet.producers.gateway", "fleet.autoscaler"} <= imported_after(
        "import fleet.cli.serving", SERVER
    )


def imported_modules(log: str) -> set[str]:
    """The modules named in ``-X importtime`` lines (``import time: self | cumulative | name``)."""
    return {
        line.rsplit("|", 1)[1].strip() for line in log.splitlines() if line.startswith("import time:") and "|" in line
    }


@pytest.mark.slow
def test_a_serving_echo_worker_process_imports_no_server_code(nats_url: str, redis_url: str, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "worker.log"
    env = {"FLEET_BROKER_URL": nats_url, "FLEET_STORE_URL": redis_url, "PYTHONPROFILEIMPORTTIME": "1"}
    with fleet_process("worker", "--model", "echo", "--metrics-port", str(port), env=env, log=log) as proc:
        wait_http_ready(f"http://127.0.0.1:{port}/readyz", proc, log)
        assert stop(proc) == 0, log.read_text()[-2000:]
    imported = imported_modules(log.read_text())
    assert {"fleet.consumers.worker", "nats"} <= imported  # the listing is there: the check below can fail
    assert imported & set(SERVER) == set()
