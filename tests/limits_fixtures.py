"""What the tests of spec and expression limits share: a real ``fleet gateway`` process on NATS + Redis, a thread
polling its ``/healthz`` (``tests.health_probe``), and a helper that sends one request and measures both.

The gateway is a process of its own so that ``/healthz``'s latency measures the gateway's event loop, not the test's.
Its model is a per-module copy of ``echo`` and no worker serves it: runs start and their jobs wait.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.health_probe import HealthProbe
from tests.processes import fleet_process, wait_http_ready
from tests.services import free_port

HEALTHZ_BOUND_S = 0.1
"""/healthz answers within this while any request is in flight. A request whose window saw a slower probe is sent
once more and measured again (a 2-core machine shared with other work can hold a process off the CPU for a while);
a loop that a request really blocks is blocked both times."""
REQUEST_BOUND_S = 1.0


@dataclass
class Gateway:
    base: str
    echo: str  # the model the gateway validates specs against
    http: httpx.Client
    probe: HealthProbe

    def send(self, method: str, path: str, **kwargs: object) -> tuple[httpx.Response, float, float]:
        """The response, its latency and /healthz's worst latency while it was in flight (re-measured once when
        the latter is over ``HEALTHZ_BOUND_S``)."""
        response, seconds, worst = self._send(method, path, **kwargs)
        if worst >= HEALTHZ_BOUND_S:
            response, seconds, worst = self._send(method, path, **kwargs)
        return response, seconds, worst

    def _send(self, method: str, path: str, **kwargs: object) -> tuple[httpx.Response, float, float]:
        self.probe.settle()
        since = time.monotonic()
        response = self.http.request(method, path, **kwargs)  # type: ignore[arg-type]
        seconds = time.monotonic() - since
        self.probe.settle()
        return response, seconds, self.probe.worst(since)


@pytest.fixture(scope="module", name="gateway")
def gateway_fixture(redis_url: str, nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    token = uuid.uuid4().hex[:10]
    env = {
        "FLEET_BROKER_URL": nats_url,
        "FLEET_STORE_URL": redis_url,
        "FLEET_MODELS": f"tests.gateway_helpers:echo_{token}",
        "FLEET_MAX_QUEUED": "0",
        "FLEET_LOG_LEVEL": "WARNING",
    }
    port = free_port()
    log = tmp_path_factory.mktemp("limits") / "gateway.log"
    with fleet_process("gateway", "--port", str(port), env=env, log=log) as proc:
        base = f"http://127.0.0.1:{port}"
        wait_http_ready(f"{base}/readyz", proc, log)
        with httpx.Client(base_url=base, timeout=120) as http, HealthProbe(base) as probe:
            gateway = Gateway(base, f"echo-{token}", http, probe)
            warm = gateway.http.post("/v1/dags", json=one_step(gateway, "warm", "${input.a}"))  # imports, threads
            assert warm.status_code == 201, warm.text
            yield gateway
            assert not probe.errors, probe.errors[:5]
        assert proc.poll() is None, log.read_text()[-3000:]


def one_step(gateway: Gateway, name: str, expression: str) -> dict[str, object]:
    """A spec of one echo step whose input ``n`` is ``expression``."""
    step = {"id": "s", "model": gateway.echo, "input": {"n": expression}}
    return {"name": name, "steps": [step], "output": "${steps.s.output}"}
