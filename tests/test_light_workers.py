"""Light workers: torch and transformers are imported only by the handlers that need them (``embed``), so an
``echo`` or ``sleep`` worker stays small."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import ROOT, fleet_env, fleet_process, stop, wait_http_ready
from tests.services import free_port

MAX_RSS_MB = 150
HEAVY = ("torch", "transformers")


def imported_after(code: str) -> dict[str, bool]:
    """Run ``code`` in a fresh interpreter; which of the heavy modules it imported."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))"
    result = subprocess.run(
        [sys.executable, "-c", probe], env=fleet_env(), capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded: dict[str, bool] = json.loads(result.stdout.strip().splitlines()[-1])
    return loaded


BUILD = """
import fleet.cli
from fleet.brokers.memory import MemoryBroker
from fleet.cli.compose import build_worker
from fleet.settings import FleetSettings
from fleet.store.memory import MemoryStore
settings = FleetSettings()
worker = build_worker({model!r}, MemoryBroker.from_settings(settings), MemoryStore(job_ttl_s=60), settings)
worker.handler.load()
worker.handler.warmup()
"""


@pytest.mark.parametrize("model", ["echo", "sleep"])
def test_building_and_warming_an_echo_or_sleep_worker_imports_no_torch(model: str) -> None:
    assert imported_after(BUILD.format(model=model)) == dict.fromkeys(HEAVY, False)


def test_the_embed_handler_imports_torch_only_when_it_loads() -> None:
    resolved = "from fleet.consumers.handlers import resolve_handler\nresolve_handler('embed')(device='cpu')"
    assert imported_after(resolved) == dict.fromkeys(HEAVY, False)
    loaded = resolved.replace("(device='cpu')", "(device='cpu').load()")
    assert imported_after(loaded) == dict.fromkeys(HEAVY, True)  # the check above can fail


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["echo", "sleep"])
def test_a_serving_echo_or_sleep_worker_stays_under_150_mb(
    model: str, nats_url: str, redis_url: str, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "worker.log"
    env = {"FLEET_BROKER_URL": nats_url, "FLEET_STORE_URL": redis_url}
    with fleet_process("worker", "--model", model, "--metrics-port", str(port), env=env, log=log) as proc:
        wait_http_ready(f"http://127.0.0.1:{port}/readyz", proc, log)
        rss = rss_mb(proc.pid)
        assert rss < MAX_RSS_MB, f"{model} worker uses {rss:.0f} MB"
        assert stop(proc) == 0, log.read_text()[-2000:]
