"""A real Jaeger (v1.75.0, all-in-one) for the tracing tests: OTLP over HTTP in, the query API out.

``scripts/jaeger/build.sh`` builds it from the Go module proxy once and caches it (``make test`` runs it through
``scripts/services.sh`` before the suite); ``jaeger_server`` starts it on free ports with
``scripts/jaeger/config.yaml`` (traces in memory) and stops it by PID. ``FLEET_TEST_JAEGER_OTLP`` and
``FLEET_TEST_JAEGER_QUERY`` point the tests at a running one instead.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fleet.errors import ServiceUnavailable
from tests.services import die_with_parent, free_port, stop_server, wait_port

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "scripts" / "jaeger" / "build.sh"
CONFIG = ROOT / "scripts" / "jaeger" / "config.yaml"
BUILD_TIMEOUT_S = 900


@dataclass(frozen=True)
class Jaeger:
    otlp_endpoint: str  # OTEL_EXPORTER_OTLP_ENDPOINT for an OTLP/HTTP exporter, e.g. http://127.0.0.1:4318
    query_url: str  # the query API: GET {query_url}/api/traces?service=...; /api/traces/{trace_id}
    pid: int | None = None  # the server's process when this started it (benchmarks read its CPU time)


def jaeger_binary() -> str:
    """The cached Jaeger binary's path (built now if the cache is empty: minutes)."""
    try:
        proc = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise ServiceUnavailable("jaeger", f"{BUILD} did not finish within {BUILD_TIMEOUT_S}s") from exc
    path = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if proc.returncode != 0 or not os.access(path, os.X_OK):
        raise ServiceUnavailable("jaeger", f"{BUILD} failed:\n{proc.stderr[-2000:]}")
    return path


@contextlib.contextmanager
def jaeger_server(timeout_s: float = 30) -> Iterator[Jaeger]:
    otlp, query = os.environ.get("FLEET_TEST_JAEGER_OTLP"), os.environ.get("FLEET_TEST_JAEGER_QUERY")
    if otlp and query:
        yield Jaeger(otlp, query)
        return
    binary = jaeger_binary()
    otlp_port, query_port, grpc_port = free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "JAEGER_OTLP_PORT": str(otlp_port),
        "JAEGER_QUERY_PORT": str(query_port),
        "JAEGER_QUERY_GRPC_PORT": str(grpc_port),
    }
    with tempfile.TemporaryDirectory(prefix="fleet-jaeger-") as tmp:
        log = Path(tmp) / "server.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [binary, "--config", f"file:{CONFIG}"],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=tmp,
                env=env,
                preexec_fn=die_with_parent,
            )
        try:
            wait_port("127.0.0.1", otlp_port, proc, log, timeout_s, "jaeger")
            wait_port("127.0.0.1", query_port, proc, log, timeout_s, "jaeger")
            yield Jaeger(f"http://127.0.0.1:{otlp_port}", f"http://127.0.0.1:{query_port}", proc.pid)
        finally:
            stop_server(proc)
