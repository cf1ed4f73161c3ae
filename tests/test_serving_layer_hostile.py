"""Hostile input on the serving layer's new entry points: garbage ``priority`` / ``cache`` fields straight on a
priority level's subject (the worker dead-letters them and keeps serving), and bad cache settings (a clear error,
from the settings and from the CLI without a traceback)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from fleet import constants as c
from fleet.settings import FleetSettings
from tests.gateway_helpers import ObservedWorker, urls_for
from tests.infra import PAIRS, connected_pair, request_bytes, settings_for, wait_terminal
from tests.processes import run_fleet

GARBAGE = [
    b"not json at all",
    json.dumps({"v": 1, "job_id": "g-prio", "model": "M", "input": {}, "priority": "urgent"}).encode(),
    json.dumps({"v": 1, "job_id": "g-cache", "model": "M", "input": {}, "cache": {"deep": [[[[1]]]]}}).encode(),
    json.dumps({"v": 1, "job_id": "g-type", "model": "M", "input": {}, "priority": [9]}).encode(),
    b'{"priority": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"v": 1, "job_id": "g-huge", "model": "M", "input": {}, "priority": "' + b"h" * 200_000 + b'"}',
]


@pytest.mark.parametrize("pair", PAIRS)
async def test_garbage_on_a_priority_level_is_dead_lettered_and_the_level_keeps_serving(
    request: pytest.FixtureRequest, pair: str, unique: str
) -> None:
    model = f"echo-{unique}"
    settings = settings_for(pair, urls_for(request, pair), models=[f"tests.gateway_helpers:echo_{unique}"])
    async with connected_pair(settings) as (broker, store), ObservedWorker(broker, store, model) as worker:
        for level in ("high", "low"):
            for i, body in enumerate(GARBAGE):
                data = body.replace(b'"model": "M"', f'"model": "{model}"'.encode())
                await broker.publish(c.request_subject(model, level), data, msg_id=f"{level}-garbage-{i}")
        good = {level: f"good-{level}-{unique}" for level in ("high", "low")}
        for level, job_id in good.items():
            payload = request_bytes(model, job_id, {"ok": level}, priority=level)
            await broker.publish(c.request_subject(model, level), payload, msg_id=job_id)
        records = await wait_terminal(store, list(good.values()), timeout_s=30)
        await worker.handled(2 * len(GARBAGE) + 2, timeout_s=30)
        garbage = [await store.get(job_id) for job_id in ("g-prio", "g-cache", "g-type", "g-huge")]
    assert {r.output["ok"] for r in records.values() if r.state == "succeeded"} == {"high", "low"}
    assert all(r is None or r.state != "succeeded" for r in garbage), garbage  # none became a computed job


@pytest.mark.parametrize(
    ("value", "named"),
    [("embed=l9", "l9"), ("embed=", "embed"), ('{"embed": 3}', "embed"), ("=l1", "cache")],
)
def test_bad_cache_settings_are_refused_naming_what_is_wrong(value: str, named: str) -> None:
    with pytest.raises((ValidationError, ValueError)) as error:
        FleetSettings(cache=value)
    assert named in str(error.value)


@pytest.mark.services
def test_the_gateway_refuses_a_bad_cache_setting_in_one_line() -> None:
    result = run_fleet("gateway", "--port", "0", env={"FLEET_CACHE": "embed=l1+l7"}, timeout_s=60)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "l7" in result.stderr, result.stderr
