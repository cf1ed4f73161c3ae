"""Rollouts end to end on NATS + Redis: jobs through the gateway (its traffic policy splits them between versions),
one worker that serves both versions of the model (the model pool, each version on its own handler), the settle hook
that counts each version's outcomes, and the rollout controller's loop.

- a canary whose handler fails 30 % of its jobs is rolled back within the controller's window, the reason on the
  timeline, and the jobs after it all go to the primary;
- a canary that fails every job opens its breaker: its share falls back to the primary; once it works again, a
  half-open probe goes through and closes the breaker, and the canary answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest

from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.pool import ModelPool, ServedVersions
from fleet.consumers.version_outcomes import VersionOutcomes
from fleet.consumers.worker import Worker
from fleet.errors import ModelError
from fleet.lifecycle.service import RolloutService
from fleet.producers.gateway import create_app
from fleet.schemas.models import EchoInput, EchoOutput
from fleet.store.bundle import Stores
from fleet.store.rollouts import RolloutDoc
from tests.gateway_helpers import FAST_LIMITS, WORKER_SETTINGS
from tests.infra import connected_pair
from tests.traffic_fixtures import TOKEN, traffic_settings, versioned_model

WINDOW_S = 60.0


class Canary(EchoHandler):
    """Version 2 of the model: echoes, but fails the jobs for which ``failing(n)`` holds (n counts the jobs it
    computed; its warm-up is not one)."""

    failing: ClassVar[Callable[[int], bool]] = staticmethod(lambda n: False)
    computed: ClassVar[int] = 0

    def predict(self, batch: list[EchoInput]) -> list[EchoOutput | Exception]:
        out: list[EchoOutput | Exception] = []
        for item, answer in zip(batch, super().predict(batch), strict=True):
            if item.root == self.sample_input().root:  # the pool's warm-up: not a job
                out.append(answer)
                continue
            Canary.computed += 1
            failed = Canary.failing(Canary.computed)
            out.append(ModelError(f"canary failed on {item.root}", retriable=False) if failed else answer)
        return out


@dataclass
class Env:
    model: str
    http: httpx.AsyncClient
    stores: Stores

    async def doc(self) -> RolloutDoc:
        doc = await self.stores.rollouts.read(self.model)
        assert doc is not None
        return doc

    async def submit(self, n: int) -> list[dict[str, Any]]:
        """``n`` jobs, then their terminal records (succeeded or failed)."""
        ids = []
        for i in range(n):
            answer = await self.http.post("/v1/jobs", json={"model": self.model, "input": {"i": i}})
            assert answer.status_code == 202, answer.text
            ids.append(answer.json()["job_id"])
        records = []
        for job_id in ids:
            answer = await self.http.get(f"/v1/jobs/{job_id}", params={"wait": 20})
            assert answer.status_code == 200 and answer.json()["state"] in ("succeeded", "failed"), answer.text
            records.append(answer.json())
        return records


@pytest.fixture
async def env(nats_url: str, redis_url: str, tmp_path: Path) -> AsyncIterator[Env]:
    model = f"ro-{uuid.uuid4().hex[:10]}"
    repository = versioned_model(tmp_path / "models", model, ("1", "2"))
    urls = {"nats": nats_url, "redis": redis_url}
    settings = traffic_settings(urls, repository, model)
    Canary.failing, Canary.computed = staticmethod(lambda n: False), 0
    primary, canary = with_name(EchoHandler, model), with_name(Canary, model)
    served = ServedVersions(model, "1", lambda v: canary() if v == "2" else primary(), lambda: ["1", "2"])
    async with connected_pair(settings) as (broker, store), contextlib.AsyncExitStack() as stack:
        stores = Stores.beside(store)
        outcomes = VersionOutcomes(store, stores.rollouts)
        pool = ModelPool(None)
        stack.push_async_callback(pool.close)
        app = create_app(settings, broker=broker, stores=stores, limits=FAST_LIMITS)
        await stack.enter_async_context(app.router.lifespan_context(app))
        worker = Worker(
            primary(), broker, store, settings=WORKER_SETTINGS, worker_id=f"w-{model}", max_wait_ms=2,
            on_settled=[outcomes.on_settled], pool=pool, versions=served,
        )  # fmt: skip
        await stack.enter_async_context(worker)
        controller = RolloutService(stores.rollouts, interval_s=0.2, window_s=WINDOW_S, lock_ttl_s=5)
        await stack.enter_async_context(controller)
        transport = httpx.ASGITransport(app=app)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        http = await stack.enter_async_context(
            httpx.AsyncClient(transport=transport, base_url="http://gateway", headers=headers, timeout=30)
        )
        yield Env(model, http, stores)


async def until(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout_s:g}s (last: {last!r})")


async def test_a_canary_failing_30_percent_of_its_jobs_is_rolled_back_within_the_window(env: Env) -> None:
    Canary.failing = staticmethod(lambda n: n % 10 < 3)  # 3 of every 10 jobs it computes
    # judged on errors: version 2's first jobs wait for its load, which p99 is not asked to forgive here
    rollout = {"steps": [0.3, 1.0], "min_requests": 30, "hold_s": 0, "min_agreement": None, "max_p99_ratio": 1000}
    quiet = {"consecutive_failures": 1000, "error_rate": 1.0}  # the breaker stays out of this test
    body = {"policy": {"primary": "1", "canary": "2"}, "rollout": rollout, "breaker": quiet}
    assert (await env.http.put(f"/v1/models/{env.model}/traffic", json=body)).status_code == 200
    await until(lambda: _weight_is(env, 0.3), 10, "the controller starts the canary at 30 %")
    started = time.monotonic()
    records: list[dict[str, Any]] = []
    while (await env.doc()).state.phase == "rolling":
        assert time.monotonic() - started < WINDOW_S, "no rollback within the window"
        records += await env.submit(20)
    took_s = time.monotonic() - started
    doc = await env.doc()
    assert doc.state.phase == "rolled_back" and doc.policy.canary_weight == 0.0, doc
    canary = [r for r in records if r["version"] == "2"]
    failed = [r for r in canary if r["state"] == "failed"]
    assert len(canary) >= 30 and 0.2 <= len(failed) / len(canary) <= 0.4, (len(canary), len(failed))
    assert all(r["state"] == "succeeded" for r in records if r["version"] == "1")
    [entry] = [d for d in await env.stores.rollouts.decisions(env.model) if d.action == "roll_back"]
    assert (
        entry.by == "controller" and entry.reason.startswith("canary errors ") and "against primary 0 %" in entry.reason
    )
    assert entry.reason.endswith("rolled back from 30 % to 0 %") and took_s < WINDOW_S
    await asyncio.sleep(1.2)  # the gateways' copy of the policy (refreshed every second)
    after = await env.submit(20)
    assert {r["version"] for r in after} == {"1"} and all(r["state"] == "succeeded" for r in after)


async def test_a_failing_canary_opens_its_breaker_falls_back_and_a_probe_closes_it(env: Env) -> None:
    Canary.failing = staticmethod(lambda n: True)
    breaker = {"consecutive_failures": 3, "cool_down_s": 6.0, "max_cool_down_s": 12.0}
    body = {"policy": {"primary": "1", "canary": "2", "canary_weight": 0.5}, "rollout": None, "breaker": breaker}
    assert (await env.http.put(f"/v1/models/{env.model}/traffic", json=body)).status_code == 200

    async def opened() -> bool:
        await env.submit(6)
        return (await env.doc()).breakers.get("2") is not None and (await env.doc()).breakers["2"].status == "open"

    await until(opened, 30, "the canary's breaker opens")
    doc = await env.doc()
    assert "consecutive failures" in doc.breakers["2"].reason
    await asyncio.sleep(1.2)  # the gateways' copy of the policy (refreshed every second)
    fallback = await env.submit(10)  # within the cool-down: the canary's share goes to the primary
    assert (await env.doc()).breakers["2"].status == "open", "the cool-down ended before the check"
    assert {r["version"] for r in fallback} == {"1"} and all(r["state"] == "succeeded" for r in fallback)
    Canary.failing = staticmethod(lambda n: False)  # mended

    async def closed() -> bool:
        await env.submit(4)
        state = (await env.doc()).breakers["2"]
        return state.status == "closed"

    await until(closed, 30, "a half-open probe succeeds and the breaker closes")
    await asyncio.sleep(1.2)  # the gateways' copy of the policy
    back = await env.submit(30)
    assert "2" in {r["version"] for r in back} and all(r["state"] == "succeeded" for r in back)
    reasons = [d.reason for d in reversed(await env.stores.rollouts.decisions(env.model)) if d.action == "breaker"]
    assert any("opened" in r for r in reasons) and reasons[-1] == "2: closed: a probe succeeded", reasons


async def _weight_is(env: Env, weight: float) -> bool:
    doc = await env.stores.rollouts.read(env.model)
    return doc is not None and doc.policy.canary_weight == weight
