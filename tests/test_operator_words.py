"""The dashboard's words (the reason behind desired replicas, decisions listed once while nothing changes) and its
recent jobs (a bounded ring of ids, read per viewer)."""

from __future__ import annotations

from typing import Any

import pytest

from fleet.producers.gateway.operator.words import collapse_decisions, rate_text, scaling_reason
from fleet.producers.gateway.recent_jobs import RecentJobIds, read_recent
from fleet.schemas.jobs import JobRecord, JobState
from fleet.schemas.scaling import DecisionRecord, Pin, ScalingStatus
from fleet.store.memory import MemoryStore


def status(**fields: Any) -> ScalingStatus:
    values: dict[str, Any] = {
        "model": "sleep",
        "current_replicas": 1,
        "desired_replicas": 1,
        "lag": 0,
        "arrival_rate": 0.0,
        "min_replicas": 0,
        "max_replicas": 4,
        "paused": False,
        "backend": "process",
        "updated_at": 1000.0,
        "throughput_per_replica": None,
    }
    wanted = fields.pop("wanted", None)
    values.update(fields)
    if wanted is not None:
        values["decisions"] = [decision(1000.0, desired=wanted)]
    return ScalingStatus(**values)


def decision(at: float, current: int = 1, replicas: int = 1, desired: int = 1, changed: bool = False) -> DecisionRecord:
    return DecisionRecord(
        at=at,
        model="sleep",
        current_replicas=current,
        desired_replicas=desired,
        replicas=replicas,
        lag=0,
        arrival_rate=0.0,
        throughput_per_replica=None,
        reason="hold",
        changed=changed,
    )


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (0.25, "0.25"),
        (1.5, "1.5"),
        (4.256, "4.26"),
        (7.96, "8"),
        (12.4, "12"),
        (999, "999"),
        (9999, "10k"),
        (222568.58, "223k"),
        (3_400_000, "3.4M"),
    ],
)
def test_rates_read_as_a_person_writes_them(value: float, text: str) -> None:
    assert rate_text(value) == text


@pytest.mark.parametrize(
    ("fields", "text"),
    [
        (
            {"lag": 77, "throughput_per_replica": 7.96, "wanted": 10, "desired_replicas": 4, "current_replicas": 4},
            "77 waiting, draining at 8/s per worker: 10 workers wanted, capped at max 4",
        ),
        (
            {"lag": 77, "arrival_rate": 2.5, "throughput_per_replica": 8.0, "wanted": 3, "desired_replicas": 3},
            "77 waiting, 2.5/s arriving, draining at 8/s per worker: 3 workers wanted; 1 running, adding 2",
        ),
        (
            {"lag": 5, "throughput_per_replica": 222568.58, "wanted": 1},
            "5 waiting, draining at 223k/s per worker: 1 worker wanted",
        ),
        (
            {"lag": 0, "wanted": 0, "min_replicas": 1},
            "idle: nothing waiting or arriving, 0 wanted, raised to min 1",
        ),
        (
            {"lag": 0, "wanted": 0, "desired_replicas": 0, "current_replicas": 2},
            "idle: nothing waiting or arriving, 0 wanted; 2 running, removing 2 once the load has stayed low",
        ),
        (
            {"lag": 9, "wanted": 1},
            "9 waiting, throughput per worker not measured yet: 1 worker wanted",
        ),
        (
            {"lag": 40, "throughput_per_replica": 1.0, "wanted": 6, "desired_replicas": 2, "max_replicas": 8},
            "40 waiting, draining at 1/s per worker: 6 workers wanted, capped at 2 (one per partition); "
            "1 running, adding 1",
        ),
        ({"paused": True, "wanted": 3}, "autoscaling paused: holding 1 (the signals ask for 3)"),
        (  # the status's own recommendation (same tick as its lag) wins over the newest stored decision's
            {"lag": 3, "throughput_per_replica": 10.0, "wanted": 0, "wanted_replicas": 1},
            "3 waiting, draining at 10/s per worker: 1 worker wanted",
        ),
        ({"lag": None}, "queue length unknown: holding 1"),
        (
            {"backend": None, "updated_at": None},
            "no autoscaler has reported for this model: replicas are whatever was started by hand",
        ),
        ({"pinned": Pin(replicas=3, until=3600.0)}, "held at 3 by an operator until 01:00:00 UTC"),
    ],
)
def test_the_reason_behind_desired_replicas_in_words(fields: dict[str, Any], text: str) -> None:
    assert scaling_reason(status(**fields)) == text


def test_alike_no_change_decisions_are_listed_once_with_a_count_and_their_first_time() -> None:
    newest_first = [
        decision(160),
        decision(130),
        decision(100),
        decision(70, current=1, replicas=1, desired=2),
        decision(40, current=0, replicas=1, desired=1, changed=True),
        decision(30, current=0, replicas=1, desired=1, changed=True),
        decision(0),
    ]
    lines = collapse_decisions(newest_first)
    assert [(line.at, line.since, line.repeats) for line in lines] == [
        (160, 100, 3),  # the idle holds: one line
        (70, 70, 1),  # another recommendation: its own line
        (40, 40, 1),  # changes are never merged
        (30, 30, 1),
        (0, 0, 1),
    ]


def test_nothing_to_collapse() -> None:
    assert collapse_decisions([]) == []


async def test_recent_jobs_are_newest_first_bounded_and_each_viewer_sees_its_tenants() -> None:
    store = MemoryStore(job_ttl_s=60)
    ids = RecentJobIds(kept=5)
    for i in range(7):
        tenant = "acme" if i % 2 else None
        await store.create(JobRecord(job_id=f"j{i}", model="echo", state=JobState.queued, tenant=tenant))
        ids.note(f"j{i}")
    everyone = await read_recent(ids, store, limit=10)
    assert [j.job_id for j in everyone.jobs] == ["j6", "j5", "j4", "j3", "j2"]  # the ring forgot j0 and j1
    acme = await read_recent(ids, store, limit=10, viewer="acme")
    assert [j.job_id for j in acme.jobs] == ["j5", "j3"]
    assert [j.job_id for j in (await read_recent(ids, store, limit=1, viewer="default")).jobs] == ["j6"]
