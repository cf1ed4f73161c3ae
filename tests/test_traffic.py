"""Traffic policies end to end on NATS + Redis: a gateway serving a model of three versions from its repository, the
real worker of the model with the settle hook of ``fleet.consumers.version_outcomes``, and API keys of two tenants.

A 10 % canary answers 10 % +- 2 % of 5,000 jobs (counted by the version their terminal records name); a sticky
policy keeps every tenant on one version and a raised weight only moves tenants from the primary to the canary;
shadow copies are computed, stored, compared and never shown to a client; a job naming ``name@version`` bypasses
the split; open breakers send a canary's share to the primary and refuse the primary with 503 and Retry-After,
half-open lets one probe through; a Redis outage of the policies leaves requests routed by the last policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections import Counter
from typing import Any

import pytest
from prometheus_client import REGISTRY
from websockets.asyncio.client import connect as ws_connect

from fleet import constants as c
from fleet.lifecycle.breaker import BreakerState
from fleet.producers.sdk import ws_url
from fleet.store.rollouts import RolloutDoc, WindowStats
from tests.gateway_helpers import error_of
from tests.infra import eventually
from tests.traffic_fixtures import DEFAULT_VERSION, TrafficEnv, env_fixture, without_lifespan  # noqa: F401  (fixtures)

pytestmark = pytest.mark.services


async def _versions(env: TrafficEnv, job_ids: list[str]) -> Counter[str]:
    """The versions the terminal records of ``job_ids`` name, once every one is terminal."""
    records: list[Any] = []

    async def all_terminal() -> bool:
        nonlocal records
        records = await env.store.get_many(job_ids)
        return all(r is not None and r.terminal for r in records)

    await eventually(all_terminal, 60, "every job terminal")
    assert all(r.state.value == "succeeded" for r in records)
    return Counter(r.version for r in records)


async def _counted(env: TrafficEnv, expected: dict[str, int]) -> dict[str, WindowStats]:
    """The versions' windows once the settle hook counted ``expected`` requests of each (a terminal record is
    written before its hook runs, so the counts may trail the records a moment)."""
    window: dict[str, WindowStats] = {}

    async def counted() -> bool:
        nonlocal window
        await env.outcomes.drain()
        window = await env.stores.rollouts.window(env.model, list(expected), 300)
        return {v: window[v].requests for v in expected} == expected

    await eventually(counted, 20, f"outcomes counted {expected}")
    return window


async def _submit_many(env: TrafficEnv, count: int, make: Any) -> list[str]:
    ids: list[str] = []
    for start in range(0, count, 100):
        ids += await asyncio.gather(*(env.submit(env.a, make(i)) for i in range(start, min(count, start + 100))))
    return ids


def routed(model: str, version: str, arm: str) -> float:
    labels = {"model": model, "version": version, "arm": arm}
    return REGISTRY.get_sample_value("fleet_gateway_routed_total", labels) or 0.0


def turned(model: str, version: str, outcome: str) -> float:
    labels = {"model": model, "version": version, "outcome": outcome}
    return REGISTRY.get_sample_value("fleet_gateway_breaker_turned_total", labels) or 0.0


# -- the split ------------------------------------------------------------------------------------------------
async def test_a_ten_percent_canary_answers_ten_percent_of_5000_jobs(env: TrafficEnv) -> None:
    await env.set_policy(primary="1", canary="2", canary_weight=0.1)
    ids = await _submit_many(env, 5000, lambda i: {"i": i})
    versions = await _versions(env, ids)
    assert set(versions) == {"1", "2"}
    share = versions["2"] / 5000
    assert 0.08 <= share <= 0.12, versions
    window = await _counted(env, {"1": versions["1"], "2": versions["2"]})
    assert window["2"].failures == 0 and window["2"].p99_ms is not None
    assert routed(env.model, "2", "canary") == versions["2"] and routed(env.model, "1", "primary") == versions["1"]


async def test_a_model_without_a_policy_is_routed_as_before(env: TrafficEnv) -> None:
    job_id = await env.submit(env.a, {"x": 1})
    record = await env.done(env.a, job_id)
    # no version on the message: the worker's default answered, and its record says which
    assert record["version"] == DEFAULT_VERSION and record["arm"] is None and record["shadow_of"] is None
    assert c.HEADER_VERSION not in env.deliveries[job_id].headers
    assert json.loads(env.deliveries[job_id].data)["version"] is None
    assert await env.store.get(job_id + c.SHADOW_JOB_SUFFIX) is None


async def test_a_job_naming_its_version_bypasses_the_split(env: TrafficEnv) -> None:
    await env.set_policy(primary="1", canary="2", canary_weight=1.0)
    response = await env.a.post("/v1/jobs", json={"model": f"{env.model}@1", "input": {"x": 1}})
    assert response.status_code == 202, response.text
    record = await env.done(env.a, response.json()["job_id"])
    assert record["version"] == "1" and record["arm"] is None and record["model"] == env.model
    split = await env.done(env.a, await env.submit(env.a, {"x": 2}))
    assert split["version"] == "2" and split["arm"] == "canary"
    unknown = await env.a.post("/v1/jobs", json={"model": f"{env.model}@7", "input": {"x": 1}})
    assert unknown.status_code == 404 and error_of(unknown)["type"] == "unknown_model"


async def test_the_published_message_names_its_version_in_a_header(env: TrafficEnv) -> None:
    await env.set_policy(primary="2")
    job_id = await env.submit(env.a, {"x": 1})
    record = await env.done(env.a, job_id)
    assert record["version"] == "2" and record["arm"] == "primary"
    delivery = env.deliveries[job_id]
    assert delivery.headers[c.HEADER_VERSION] == "2" and delivery.headers[c.HEADER_MODEL] == env.model
    assert json.loads(delivery.data)["version"] == "2" and json.loads(delivery.data)["arm"] == "primary"


# -- sticky ---------------------------------------------------------------------------------------------------
async def test_sticky_tenants_keep_their_version_and_a_raised_weight_only_moves_them_to_the_canary(
    env: TrafficEnv,
) -> None:
    tenants = [f"t{i:02d}-{env.model[-10:]}" for i in range(60)]
    clients = [env.client((await env.stores.keys.create(t, "submitter", None))[0]) for t in tenants]
    try:
        before = await _tenant_versions(env, clients, 0.2)
        after = await _tenant_versions(env, clients, 0.6)
    finally:
        await asyncio.gather(*(client.aclose() for client in clients))
    moved = [t for t, b, a in zip(tenants, before, after, strict=True) if b != a]
    assert all(before[i] == "1" and after[i] == "2" for i, t in enumerate(tenants) if t in moved)
    assert moved, "with 60 tenants, some move from 20 % to 60 %"
    assert "2" in before and "1" in after


async def _tenant_versions(env: TrafficEnv, clients: list[Any], weight: float) -> list[str]:
    """Each tenant's one version at ``weight`` (five jobs each, all on the same version)."""
    await env.set_policy(primary="1", canary="2", canary_weight=weight, sticky={"source": "tenant"})
    out = []
    for client in clients:
        ids = await asyncio.gather(*(env.submit(client, {"n": n}) for n in range(5)))
        seen = {(await env.done(client, job_id))["version"] for job_id in ids}
        assert len(seen) == 1, seen
        out.append(seen.pop())
    return out


async def test_a_sticky_field_sends_every_job_of_a_user_to_one_version(env: TrafficEnv) -> None:
    await env.set_policy(primary="1", canary="2", canary_weight=0.5, sticky={"source": "field", "name": "user"})
    for user in ("ann", "bob", "cyd", "dee"):
        ids = [await env.submit(env.a, {"user": user, "n": n}) for n in range(4)]
        assert len({(await env.done(env.a, job_id))["version"] for job_id in ids}) == 1


# -- shadow ---------------------------------------------------------------------------------------------------
async def test_shadow_outputs_are_stored_compared_and_never_returned(env: TrafficEnv) -> None:
    await env.set_policy(primary="1", shadow="3", shadow_share=1.0)
    ids = [await env.submit(env.a, {"n": n}) for n in range(5)]
    for job_id in ids:
        record = await env.done(env.a, job_id)
        assert record["job_id"] == job_id and record["version"] == "1" and record["arm"] == "primary"
        assert record["shadow_of"] is None and record["output"] == {"n": ids.index(job_id)}
    shadows = await env.store.get_many([job_id + c.SHADOW_JOB_SUFFIX for job_id in ids])

    async def shadows_done() -> bool:
        nonlocal shadows
        shadows = await env.store.get_many([job_id + c.SHADOW_JOB_SUFFIX for job_id in ids])
        return all(s is not None and s.terminal for s in shadows)

    await eventually(shadows_done, 20, "every shadow terminal")
    for job_id, shadow in zip(ids, shadows, strict=True):
        assert shadow is not None and shadow.version == "3" and shadow.arm == "shadow" and shadow.shadow_of == job_id
        assert shadow.tenant == env.tenant_a and shadow.output == {"n": ids.index(job_id), "by": "3"}
    # no client reads a shadow by its id: the submitter, another tenant and an operator key get an unknown id's 404
    shadow_id, unknown = ids[0] + c.SHADOW_JOB_SUFFIX, f"nope-{uuid.uuid4().hex}"
    for client in (env.a, env.b, env.operator, env.b_operator):
        refused, missing = await client.get(f"/v1/jobs/{shadow_id}"), await client.get(f"/v1/jobs/{unknown}")
        assert refused.status_code == missing.status_code == 404
        assert refused.text.replace(shadow_id, "ID") == missing.text.replace(unknown, "ID")
        waited = await client.get(f"/v1/jobs/{shadow_id}", params={"wait": 1})
        assert waited.status_code == 404
        cancelled = await client.post(f"/v1/jobs/{shadow_id}/cancel")
        assert cancelled.status_code == 404
    # a client may not take a shadow's id for a job of its own
    taken = await env.a.post("/v1/jobs", json={"model": env.model, "input": {}, "job_id": "mine.shadow"})
    assert taken.status_code == 422 and "shadow" in error_of(taken)["message"]
    # the operator sees the comparisons: both digests and the score

    async def compared() -> bool:
        await env.outcomes.drain()
        return len(await env.stores.rollouts.comparisons(env.model)) == 5

    await eventually(compared, 10, "five comparisons")
    listed = await env.operator.get(f"/v1/models/{env.model}/comparisons")
    assert listed.status_code == 200, listed.text
    entries = listed.json()
    assert {e["job_id"] for e in entries} == set(ids)
    # version 3 answers otherwise: each comparison saw it (exact equality, the handler runtime's measure)
    assert all(e["score"] == 0.0 and e["output_digest"] != e["shadow_output_digest"] for e in entries)
    assert all(e["runtime"] is None or e["runtime"] == "handler" for e in entries)
    assert all(e["version"] == "1" and e["shadow_version"] == "3" for e in entries)
    window = await _counted(env, {"1": 5, "3": 5})  # the shadow counts for its own version only
    assert window["3"].agreement == 0.0 and window["3"].agreement_samples == 5
    assert routed(env.model, "3", "shadow") == 5 and routed(env.model, "1", "primary") == 5
    assert (await env.a.get(f"/v1/models/{env.model}/comparisons")).status_code == 403


async def test_a_shadow_that_answers_alike_agrees(env: TrafficEnv) -> None:
    await env.set_policy(primary="1", shadow="2", shadow_share=1.0)
    ids = [await env.submit(env.a, {"same": n}) for n in range(3)]
    for job_id in ids:
        await env.done(env.a, job_id)

    async def compared() -> bool:
        await env.outcomes.drain()
        return len(await env.stores.rollouts.comparisons(env.model)) == 3

    await eventually(compared, 20, "three comparisons")
    entries = await env.stores.rollouts.comparisons(env.model)
    assert all(e.score == 1.0 and e.output_digest == e.shadow_output_digest for e in entries)
    assert (await env.stores.rollouts.window(env.model, ["2"], 300))["2"].agreement == 1.0


async def test_websockets_push_the_primary_and_treat_its_shadow_as_unknown(env: TrafficEnv) -> None:
    await env.set_policy(primary="1", shadow="2", shadow_share=1.0)
    job_id = await env.submit(env.a, {"ws": 1})
    await env.done(env.a, job_id)
    shadow_id, ghost = job_id + c.SHADOW_JOB_SUFFIX, f"ghost-{uuid.uuid4().hex}"
    auth = {"Authorization": env.a.headers["Authorization"]}
    async with without_lifespan(env.app) as base:
        async with ws_connect(ws_url(base, "/v1/ws"), additional_headers=auth) as ws:
            await ws.send(json.dumps({"subscribe": [job_id, shadow_id, ghost]}))
            frames = {f.get("job_id") or f["job"]["job_id"]: f for f in [json.loads(await ws.recv()) for _ in range(3)]}
        async with ws_connect(ws_url(base, f"/v1/jobs/{shadow_id}/ws"), additional_headers=auth) as ws:
            frame = json.loads(await ws.recv())
            with contextlib.suppress(Exception):
                await ws.recv()
            close_code = ws.close_code
    assert frames[job_id]["type"] == "result" and frames[job_id]["job"]["version"] == "1"
    assert frames[job_id]["job"]["shadow_of"] is None
    assert json.dumps(frames[shadow_id]).replace(shadow_id, "ID") == json.dumps(frames[ghost]).replace(ghost, "ID")
    assert close_code == 4404 and "error" in frame


async def test_infer_answers_the_primary_only(env: TrafficEnv) -> None:
    await env.set_policy(primary="2", shadow="1", shadow_share=1.0)
    response = await env.a.post("/v1/infer", json={"model": env.model, "input": {"q": 1}})
    assert response.status_code == 200, response.text
    assert response.json()["output"] == {"q": 1}


# -- breakers -------------------------------------------------------------------------------------------------
async def _set_breakers(env: TrafficEnv, **states: BreakerState) -> None:
    doc = await env.stores.rollouts.read(env.model)
    assert doc is not None
    changed = doc.model_copy(update={"breakers": {**doc.breakers, **states}})
    assert await env.stores.rollouts.write(changed, doc.revision)
    await env.traffic.refresh()


def _open(opened_at_s: float) -> BreakerState:
    return BreakerState(status="open", opened_at_s=opened_at_s, cool_down_s=30.0, reason="opened: 5 failures")


async def test_an_open_canary_breaker_sends_its_share_to_the_primary(env: TrafficEnv) -> None:
    import time

    await env.set_policy(primary="1", canary="2", canary_weight=1.0)
    await _set_breakers(env, **{"2": _open(time.time())})
    for n in range(5):
        record = await env.done(env.a, await env.submit(env.a, {"n": n}))
        assert record["version"] == "1" and record["arm"] == "primary"
    assert turned(env.model, "2", "fallback") == 5


async def test_an_open_primary_breaker_answers_503_with_retry_after(env: TrafficEnv) -> None:
    import time

    await env.set_policy(primary="1")
    await _set_breakers(env, **{"1": _open(time.time())})
    response = await env.a.post("/v1/jobs", json={"model": env.model, "input": {}})
    assert response.status_code == 503, response.text
    error = error_of(response)
    assert error["type"] == "circuit_open" and error["details"]["version"] == "1"
    assert 28 <= int(response.headers["retry-after"]) <= 30
    assert turned(env.model, "1", "refused") == 1


async def test_a_half_open_breaker_lets_one_probe_through(env: TrafficEnv) -> None:
    import time

    await env.set_policy(primary="1")
    await _set_breakers(env, **{"1": _open(time.time() - 31)})  # the cool-down is over
    first = await env.a.post("/v1/jobs", json={"model": env.model, "input": {"probe": 1}})
    assert first.status_code == 202, first.text
    second = await env.a.post("/v1/jobs", json={"model": env.model, "input": {"probe": 2}})
    assert second.status_code == 503 and error_of(second)["details"]["breaker"] == "half_open"
    doc = await env.stores.rollouts.read(env.model)
    assert isinstance(doc, RolloutDoc)
    assert doc.breakers["1"].status == "half_open" and len(doc.breakers["1"].probes) == 1
    assert turned(env.model, "1", "probe") == 1 and turned(env.model, "1", "refused") == 1
