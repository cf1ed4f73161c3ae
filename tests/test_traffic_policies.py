"""The gateway's view of traffic policies (``fleet.producers.gateway.policies.TrafficPolicies``) with seeded draws:
the split and the shadow, explicit versions, versions that do not resolve, the breakers' fallback and refusal, and
a Redis that goes away (a private redis-server, stopped): the last policy keeps routing, nothing raises."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from fleet.errors import UnservedVersion
from fleet.lifecycle.breaker import BreakerState
from fleet.lifecycle.traffic import TrafficPolicy
from fleet.models import resolve_spec
from fleet.producers.gateway.errors import ApiError
from fleet.producers.gateway.policies import TrafficPolicies
from fleet.repository.layout import Repository
from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.bundle import Stores
from fleet.store.manifests import MemoryManifestStore
from fleet.store.rollouts import MemoryRolloutStore, RedisRolloutStore, RolloutDoc, RolloutStore
from tests.gateway_helpers import private_server
from tests.traffic_fixtures import versioned_model

MODEL = "ab-policies"


def draws(*values: float) -> Iterator[float]:
    return itertools.cycle(values)


@contextlib.asynccontextmanager
async def policies(
    tmp_path: Path, rollouts: RolloutStore, values: Iterator[float], refresh_s: float = 60
) -> AsyncIterator[TrafficPolicies]:
    repository = Repository(versioned_model(tmp_path, MODEL, ("1", "2", "3")))
    specs = {MODEL: resolve_spec(MODEL, repository)}
    made = TrafficPolicies(
        rollouts, MemoryManifestStore(), repository, specs, refresh_s=refresh_s, draw=lambda: next(values)
    )
    async with made:
        yield made


def _doc(**policy: object) -> RolloutDoc:
    return RolloutDoc(model=MODEL, policy=TrafficPolicy.model_validate(policy))


async def test_the_split_follows_the_draw_and_the_shadow_its_own(tmp_path: Path) -> None:
    # draws alternate: (split 0.05, shadow 0.95), (split 0.5, shadow 0.1)
    async with policies(tmp_path, MemoryRolloutStore(), draws(0.05, 0.95, 0.5, 0.1)) as traffic:
        spec = traffic.specs[MODEL]
        plain = await traffic.choose(spec, None, "t", {}, {})
        assert (plain.version, plain.arm, plain.shadow) == (None, None, None)
        await traffic.put(_doc(primary="1", canary="2", canary_weight=0.1, shadow="3", shadow_share=0.2))
        first = await traffic.choose(spec, None, "t", {}, {})
        assert (first.version, first.arm, first.spec.version) == ("2", "canary", "2")
        assert first.shadow is not None and first.shadow.version == "3" and first.shadow.name == MODEL
        second = await traffic.choose(spec, None, "t", {}, {})
        assert (second.version, second.arm, second.shadow) == ("1", "primary", None)
        explicit = await traffic.choose(spec, "3", "t", {}, {})
        assert (explicit.version, explicit.arm, explicit.spec.version) == ("3", None, "3")
        with pytest.raises(UnservedVersion):
            await traffic.choose(spec, "9", "t", {}, {})
        await traffic.put(_doc(primary="1"))  # version 2 is no longer named (3 is the served one)
        with pytest.raises(UnservedVersion):
            await traffic.choose(spec, "2", "t", {}, {})
        assert (await traffic.choose(spec, spec.version, "t", {}, {})).version == spec.version


async def test_a_version_that_does_not_resolve_is_not_routed_to(tmp_path: Path) -> None:
    async with policies(tmp_path, MemoryRolloutStore(), draws(0.0)) as traffic:
        await traffic.put(_doc(primary="1", canary="7", canary_weight=1.0))
        choice = await traffic.choose(traffic.specs[MODEL], None, None, {}, {})
        assert (choice.version, choice.arm) == ("1", "primary") and "not resolved" in choice.reason
        await traffic.put(_doc(primary="8"))
        plain = await traffic.choose(traffic.specs[MODEL], None, None, {}, {})
        assert plain.version is None and "plain route" in plain.reason


async def test_breakers_fall_back_refuse_and_probe(tmp_path: Path) -> None:
    rollouts = MemoryRolloutStore()
    async with policies(tmp_path, rollouts, draws(0.0)) as traffic:
        spec, now = traffic.specs[MODEL], time.time()
        opened = BreakerState(status="open", opened_at_s=now, cool_down_s=10, reason="opened: 5 consecutive failures")
        doc = _doc(primary="1", canary="2", canary_weight=1.0)
        doc.breakers["2"] = opened
        assert await rollouts.write(doc, 0)
        await traffic.refresh()
        fell_back = await traffic.choose(spec, None, None, {}, {})
        assert (fell_back.version, fell_back.arm) == ("1", "primary") and "circuit is open" in fell_back.reason
        stored = await rollouts.read(MODEL)
        assert stored is not None
        stored.breakers["1"] = opened
        assert await rollouts.write(stored, stored.revision)
        await traffic.refresh()
        with pytest.raises(ApiError) as refused:
            await traffic.choose(spec, None, None, {}, {})
        assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "10"}
        stored = await rollouts.read(MODEL)
        assert stored is not None
        stored.breakers["1"] = BreakerState(status="open", opened_at_s=now - 11, cool_down_s=10, reason="x")
        assert await rollouts.write(stored, stored.revision)
        await traffic.refresh()
        probe = await traffic.choose(spec, None, None, {}, {})
        assert probe.version == "1"
        with pytest.raises(ApiError) as busy:  # one probe at a time (half_open_probes 1)
            await traffic.choose(spec, None, None, {}, {})
        assert busy.value.details["breaker"] == "half_open"
        latest = await rollouts.read(MODEL)
        assert (
            latest is not None and latest.breakers["1"].status == "half_open" and len(latest.breakers["1"].probes) == 1
        )


@pytest.mark.services  # a private redis-server
async def test_a_redis_that_goes_away_leaves_the_last_policy_routing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with private_server("redis") as (url, proc):
        store = make_store(FleetSettings(store_url=url))
        await store.connect()
        try:
            rollouts = Stores.beside(store).rollouts
            assert isinstance(rollouts, RedisRolloutStore)
            assert await rollouts.write(_doc(primary="1", canary="2", canary_weight=0.5), 0)
            async with policies(tmp_path, rollouts, draws(0.25, 0.9, 0.75, 0.9)) as traffic:
                assert traffic.doc(MODEL) is not None
                proc.terminate()
                proc.wait(10)
                with caplog.at_level(logging.WARNING):
                    await traffic.refresh()
                    await traffic.refresh()
                warned = [r for r in caplog.records if "cannot refresh" in r.getMessage()]
                assert len(warned) == 1  # once per outage
                versions = [(await traffic.choose(traffic.specs[MODEL], None, None, {}, {})).version for _ in range(4)]
                assert versions == ["2", "1", "2", "1"]
        finally:
            await store.close()


class PausedReads(MemoryRolloutStore):
    """The memory store, whose reads wait for ``go`` once ``pause`` is set: a refresh caught mid-read."""

    def __init__(self) -> None:
        super().__init__()
        self.pause, self.go = False, asyncio.Event()

    async def read(self, model: str) -> RolloutDoc | None:
        found = await super().read(model)
        if self.pause:
            await self.go.wait()
        return found


async def test_a_refresh_that_read_before_a_change_does_not_undo_it(tmp_path: Path) -> None:
    rollouts = PausedReads()
    async with policies(tmp_path, rollouts, draws(0.5)) as traffic:
        old = _doc(primary="1")
        assert await rollouts.write(old, 0)
        await traffic.refresh()
        rollouts.pause = True
        stale = asyncio.create_task(traffic.refresh())  # reads revision 1, then waits
        await asyncio.sleep(0.01)
        new = _doc(primary="2").model_copy(update={"revision": 2})
        await traffic.put(new)
        rollouts.go.set()
        await stale
        current = traffic.doc(MODEL)
        assert current is not None and current.policy.primary == "2"
        rollouts.pause = False
        traffic.drop(MODEL)
        assert await rollouts.read(MODEL) is not None  # still stored: only this process dropped it
        rollouts.pause, rollouts.go = True, asyncio.Event()
        stale = asyncio.create_task(traffic.refresh())
        await asyncio.sleep(0.01)
        traffic.drop(MODEL)
        rollouts.go.set()
        await stale
        assert traffic.doc(MODEL) is None
