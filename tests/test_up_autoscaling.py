"""`fleet up` on real infrastructure scales its workers on a burst and back, losing and repeating no job."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.aof_redis import restartable
from tests.infra import count_completions
from tests.processes import fleet_process, stop, wait_http_ready
from tests.services import free_port

pytestmark = pytest.mark.slow


def sleep_replicas(http: httpx.Client) -> dict[str, Any]:
    [status] = [s for s in http.get("/v1/scaling").json() if s["model"] == "sleep"]
    return status


@pytest.mark.timeout(300)  # above the test's own deadlines (60 + 120 + 60 s), so a stall fails with their message
@pytest.mark.parametrize("kind", ["nats", "kafka"])
async def test_fleet_up_scales_out_on_a_burst_and_back_in_without_losing_a_job(
    kind: str, redis_url: str, tmp_path: Path
) -> None:
    # A broker of its own, on NATS and on Kafka alike: other tests' `sleep` requests left on the shared one would be
    # served first (on the shared Kafka the burst once waited past the test's timeout behind them).
    with restartable(kind) as server:
        await _scale_through_a_burst(server.url, redis_url, tmp_path)


async def _scale_through_a_burst(broker_url: str, redis_url: str, tmp_path: Path) -> None:
    counts: collections.Counter[str] = collections.Counter()
    ready = asyncio.Event()
    counter = asyncio.create_task(count_completions(redis_url, ready, counts))
    try:
        await ready.wait()
        port, log = free_port(), tmp_path / "up.log"
        env = {
            "FLEET_AUTOSCALE_INTERVAL_S": "0.5",
            "FLEET_AUTOSCALE_MAX_REPLICAS": "3",
            "FLEET_AUTOSCALE_STABILIZATION_S": "3",
            # The burst is 15 s of work for one worker: with a 3 s drain target its backlog alone asks for more workers,
            # however slowly a loaded machine lets the arrival rate be seen.
            "FLEET_AUTOSCALE_TARGET_DRAIN_S": "3",
            "FLEET_HEARTBEAT_INTERVAL_S": "0.5",
            "FLEET_KAFKA_PARTITIONS": "3",
        }
        args = ("up", "--port", str(port), "--models", "sleep", "--broker", broker_url, "--store", redis_url)
        with fleet_process(*args, env=env, log=log) as proc:
            base = f"http://127.0.0.1:{port}"
            await asyncio.to_thread(wait_http_ready, f"{base}/readyz", proc, log)
            result = await asyncio.to_thread(_burst_and_watch, base)
            assert await asyncio.to_thread(stop, proc) == 0, log.read_text()[-3000:]
    finally:  # also when the test fails: a task left pending fails the next test of this process
        counter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await counter
    ids, states, peak, final = result
    assert states == ["succeeded"] * len(ids), log.read_text()[-3000:]
    assert {j: counts[j] for j in ids} == dict.fromkeys(ids, 1), "exactly one terminal result per job"
    assert peak >= 2, f"the burst scaled the workers out (peak {peak})"
    assert final["current_replicas"] == 1, f"and back in once it drained: {final}"
    reasons = " | ".join(d["reason"] for d in final["decisions"])
    assert "up" in reasons and "down" in reasons, reasons
    assert "drain 3s" in reasons, f"FLEET_AUTOSCALE_TARGET_DRAIN_S reached the autoscaler: {reasons}"


def _burst_and_watch(base: str) -> tuple[list[str], list[str], int, dict[str, Any]]:
    with httpx.Client(base_url=base, timeout=30) as http:
        _until(lambda: sleep_replicas(http)["current_replicas"] == 1, 60, "one worker at start")
        body = {"model": "sleep", "input": {"mean_ms": 100}}
        with ThreadPoolExecutor(16) as pool:  # a burst arrives at once, not as fast as one client's round trips
            ids = list(pool.map(lambda _: http.post("/v1/jobs", json=body).json()["job_id"], range(150)))
        peak = 1

        def all_done() -> bool:
            nonlocal peak
            peak = max(peak, sleep_replicas(http)["current_replicas"])
            return all(http.get(f"/v1/jobs/{j}").json()["state"] == "succeeded" for j in ids[-10:])

        _until(all_done, 120, "the burst served")
        states = [http.get(f"/v1/jobs/{j}", params={"wait": 30}).json()["state"] for j in ids]
        _until(lambda: sleep_replicas(http)["current_replicas"] == 1, 60, "scale-in after the burst")
        return ids, states, peak, sleep_replicas(http)


def _until(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout_s}s")
