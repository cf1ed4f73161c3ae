"""The rollouts store (``fleet.store.rollouts``) on memory, Redis and a Redis Cluster under one contract: the
policy document's compare-and-set, the decisions timeline, and the per-version windows of outcomes and agreement."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from fleet.lifecycle.breaker import BreakerState
from fleet.lifecycle.controller import RolloutConfig, RolloutState
from fleet.lifecycle.traffic import TrafficPolicy
from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.bundle import Stores
from fleet.store.rollouts import (
    STATS_BUCKET_S,
    DecisionEntry,
    Outcome,
    RolloutDoc,
    RolloutStore,
    Tally,
    latency_bucket,
    summarize,
)


@pytest.fixture(params=["memory", "redis", "redis_cluster"])
async def rollouts(request: pytest.FixtureRequest) -> AsyncIterator[RolloutStore]:
    url = "memory://" if request.param == "memory" else request.getfixturevalue(f"{request.param}_url")
    store = make_store(FleetSettings(store_url=url))
    await store.connect()
    try:
        yield Stores.beside(store).rollouts
    finally:
        await store.close()


def doc_of(model: str, weight: float = 0.1) -> RolloutDoc:
    policy = TrafficPolicy(primary="1", canary="2", canary_weight=weight)
    return RolloutDoc(model=model, policy=policy, rollout=RolloutConfig())


async def test_a_document_is_written_by_compare_and_set_on_its_revision(rollouts: RolloutStore, unique: str) -> None:
    model = f"m-{unique}"
    assert await rollouts.read(model) is None
    assert not await rollouts.write(doc_of(model), expected_revision=3)  # nothing stored: only revision 0 writes
    assert await rollouts.write(doc_of(model), expected_revision=0)
    first = await rollouts.read(model)
    assert first is not None and first.revision == 1 and first.policy.canary_weight == 0.1
    state = RolloutState(step=2, step_since_s=5.0)
    changed = first.model_copy(update={"policy": first.policy.with_canary_weight(0.5), "state": state})
    changed.breakers["2"] = BreakerState(status="open", opened_at_s=7.0, reason="5 failures in a row")
    # two writers that read revision 1: one wins, the other is told to read again
    wins = await asyncio.gather(rollouts.write(changed, 1), rollouts.write(doc_of(model, 0.9), 1))
    assert sorted(wins) == [False, True]
    second = await rollouts.read(model)
    assert second is not None and second.revision == 2
    if wins[0]:
        assert second.state == state and second.breakers["2"].status == "open" and second.policy.canary_weight == 0.5
    assert model in await rollouts.models()
    await rollouts.delete(model)
    assert await rollouts.read(model) is None and model not in await rollouts.models()


async def test_decisions_are_kept_newest_first(rollouts: RolloutStore, unique: str) -> None:
    model = f"m-{unique}"
    for i in range(5):
        await rollouts.add_decision(
            DecisionEntry(at=float(i), model=model, action="step", weight=i / 10, reason=f"r{i}")
        )
    latest = await rollouts.decisions(model, limit=3)
    assert [d.reason for d in latest] == ["r4", "r3", "r2"]
    assert await rollouts.decisions(model, limit=0) == []
    assert await rollouts.decisions(f"other-{unique}") == []


async def test_a_window_sums_outcomes_latencies_and_agreement_of_each_version(
    rollouts: RolloutStore, unique: str
) -> None:
    model, now = f"m-{unique}", 1_000_000.0
    for i in range(100):
        await rollouts.record_outcome(model, "1", ok=True, latency_ms=10.0 + i % 5, now=now - i % 3)
    for i in range(10):
        await rollouts.record_outcome(model, "2", ok=i % 5 != 0, latency_ms=500.0 if i == 9 else 12.0, now=now)
    await rollouts.record_outcome(model, "2", ok=True, latency_ms=12.0, now=now - 10 * STATS_BUCKET_S)  # outside
    for score in (1.0, 0.5):
        await rollouts.record_agreement(model, "2", score, now=now)
    stats = await rollouts.window(model, ["1", "2", "3"], window_s=30, now=now)
    assert (stats["1"].requests, stats["1"].failures, stats["1"].agreement) == (100, 0, None)
    assert stats["1"].p99_ms is not None and 14.0 <= stats["1"].p99_ms <= 14.0 * 1.1
    assert (stats["2"].requests, stats["2"].failures, stats["2"].error_rate) == (10, 2, 0.2)
    assert stats["2"].p99_ms is not None and 500.0 <= stats["2"].p99_ms <= 550.0
    assert (stats["2"].agreement, stats["2"].agreement_samples) == (0.75, 2)
    assert stats["3"].requests == 0 and stats["3"].p99_ms is None


async def test_a_comparison_is_claimed_once(rollouts: RolloutStore, unique: str) -> None:
    claims = await asyncio.gather(*(rollouts.claim_comparison(f"m-{unique}", "job-1") for _ in range(5)))
    assert sorted(claims) == [False] * 4 + [True]
    assert await rollouts.claim_comparison(f"m-{unique}", "job-2")


async def test_a_tally_counts_failures_in_a_row_and_the_latest_times(rollouts: RolloutStore, unique: str) -> None:
    model = f"m-{unique}"
    assert await rollouts.tally(model, ["1"]) == {"1": Tally()}
    for i, ok in enumerate([False, False, True, False, False, False]):
        await rollouts.record_outcome(model, "2", ok=ok, latency_ms=5.0, now=100.0 + i)
    tally = (await rollouts.tally(model, ["2"]))["2"]
    assert (tally.streak, tally.total, tally.failed) == (3, 6, 5)
    assert (tally.last_ok_at, tally.last_failed_at) == (102.0, 105.0)
    await rollouts.record_outcome(model, "2", ok=True, latency_ms=None, now=106.5)
    tally = (await rollouts.tally(model, ["2"]))["2"]
    assert (tally.streak, tally.total, tally.last_ok_at) == (0, 7, 106.5)
    # the settle hook's batched form keeps the tallies too
    batch = [Outcome(model, "2", ok=False, latency_ms=5.0), Outcome(model, "3", ok=True, latency_ms=5.0)] * 2
    await rollouts.record_outcomes(batch, now=107.0)
    tallies = await rollouts.tally(model, ["2", "3"])
    assert (tallies["2"].streak, tallies["2"].total, tallies["2"].failed, tallies["2"].last_failed_at) == (
        2,
        9,
        7,
        107.0,
    )
    assert (tallies["3"].streak, tallies["3"].total, tallies["3"].last_ok_at) == (0, 2, 107.0)


async def test_one_controller_holds_the_lock_until_it_releases_it_or_it_lapses(rollouts: RolloutStore) -> None:
    a, b = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"
    try:
        assert await rollouts.acquire_lock(a, ttl_s=0.3)
        assert await rollouts.acquire_lock(a, ttl_s=0.3)  # renewed by its holder
        assert not await rollouts.acquire_lock(b, ttl_s=0.3)
        await rollouts.release_lock(b)  # not the holder: nothing happens
        assert not await rollouts.acquire_lock(b, ttl_s=0.3)
        await asyncio.sleep(0.4)
        assert await rollouts.acquire_lock(b, ttl_s=5)  # lapsed
        await rollouts.release_lock(b)
        assert await rollouts.acquire_lock(a, ttl_s=5)
    finally:
        await rollouts.release_lock(a)
        await rollouts.release_lock(b)


def test_latency_buckets_give_p99_within_ten_percent() -> None:
    for ms in (1.0, 7.5, 99.0, 1234.5, 60_000.0):
        upper = summarize({"ok": 1, f"lat:{latency_bucket(ms)}": 1}).p99_ms
        assert upper is not None and ms <= upper <= ms * 1.1 + 1e-9, (ms, upper)
    assert summarize({}).p99_ms is None and summarize({}).requests == 0
