"""The ack policy and the micro-batch limits are pure: tables of cases."""

from __future__ import annotations

import pytest

from fleet.consumers.acks import POISON_FACTOR, Action, decide, for_stored, poisoned, retry_delay_s
from fleet.consumers.stats import WorkerStats, percentile
from fleet.schemas.jobs import JobError, JobState

TRANSIENT = JobError(type="model_error", message="cuda oom", retriable=True)
PERMANENT = JobError(type="invalid_request", message="not json", retriable=False)


@pytest.mark.parametrize(
    ("error", "delivery", "max_deliveries", "action"),
    [
        (None, 1, 3, Action.ack),
        (None, 3, 3, Action.ack),
        (TRANSIENT, 1, 3, Action.retry),
        (TRANSIENT, 2, 3, Action.retry),
        (TRANSIENT, 3, 3, Action.dead_letter),
        (TRANSIENT, 1, 1, Action.dead_letter),
        (PERMANENT, 1, 3, Action.dead_letter),
    ],
)
def test_decide(error: JobError | None, delivery: int, max_deliveries: int, action: Action) -> None:
    assert decide(error, delivery, max_deliveries).action is action


def test_retry_backs_off_exponentially_with_a_cap() -> None:
    assert [retry_delay_s(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert retry_delay_s(50) == 30.0
    assert decide(TRANSIENT, 2, 5).delay_s == 1.0


@pytest.mark.parametrize(
    ("state", "action"),
    [
        (JobState.succeeded, Action.ack),
        (JobState.expired, Action.ack),
        (JobState.cancelled, Action.ack),
        (JobState.failed, Action.dead_letter),
    ],
)
def test_a_stored_failure_resends_its_dead_letter_and_every_other_end_acks(state: JobState, action: Action) -> None:
    assert for_stored(state) is action


def test_the_poison_cap_counts_broker_deliveries_far_past_the_runs_allowed() -> None:
    assert not poisoned(POISON_FACTOR * 3, 3)
    assert poisoned(POISON_FACTOR * 3 + 1, 3)


def test_stats_snapshot() -> None:
    stats = WorkerStats()
    for ms in (10.0, 20.0, 30.0, 40.0):
        stats.record_batch(4, ms, now=100.0)
    assert stats.throughput_per_s(horizon_s=10, now=105.0) == 1.6
    assert stats.throughput_per_s(horizon_s=10, now=200.0) == 0.0
    snap = stats.snapshot()
    assert snap["batches"] == 4 and snap["items"] == 16 and snap["mean_batch_size"] == 4.0
    assert snap["latency_p50_ms"] in (20.0, 30.0) and snap["latency_p99_ms"] == 40.0
    assert 10.0 < snap["latency_ewma_ms"] < 40.0
    assert percentile([], 0.5) == 0.0
