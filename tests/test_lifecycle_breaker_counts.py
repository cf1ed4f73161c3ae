"""``fleet.lifecycle.breaker_counts.judge``: a version's breaker moved by its running tally, in a table."""

from __future__ import annotations

import pytest

from fleet.lifecycle.breaker import BreakerConfig, BreakerState
from fleet.lifecycle.breaker_counts import Tally, judge

CONFIG = BreakerConfig(consecutive_failures=3, error_rate=0.5, window_s=10, min_requests=4, cool_down_s=5)
CLOSED = BreakerState()
OPEN = BreakerState(status="open", opened_at_s=100.0, cool_down_s=5.0, reason="opened")
HALF = BreakerState(status="half_open", opened_at_s=100.0, cool_down_s=5.0, reason="half-open after 5s")


@pytest.mark.parametrize(
    ("state", "now", "before", "now_s", "status", "reason"),
    [
        (CLOSED, Tally(2, 10, 2), Tally(0, 8, 0), 100.0, "closed", "closed"),
        (CLOSED, Tally(3, 10, 3), Tally(0, 7, 0), 100.0, "open", "opened: 3 consecutive failures"),
        (CLOSED, Tally(3, 10, 3), None, 100.0, "open", "opened: 3 consecutive failures"),  # a new controller
        (CLOSED, Tally(0, 4, 2), Tally(), 100.0, "open", "opened: 2 of 4 requests failed in 10s (50 %, limit 50 %)"),
        (CLOSED, Tally(0, 3, 2), Tally(), 100.0, "closed", "closed"),  # below min_requests
        (CLOSED, Tally(0, 40, 20), None, 100.0, "closed", "closed"),  # no previous tally: nothing in the window
        (OPEN, Tally(9, 20, 9), Tally(9, 20, 9), 104.9, "open", "opened"),
        (OPEN, Tally(9, 20, 9), Tally(9, 20, 9), 105.0, "half_open", "half-open after 5s"),
        (HALF, Tally(0, 21, 9, last_ok_at=105.5), None, 106.0, "closed", "closed: a probe succeeded"),
        (HALF, Tally(10, 21, 10, last_failed_at=105.5), None, 106.0, "open", "reopened: a probe failed; open for 10s"),
        (HALF, Tally(0, 22, 10, 105.6, 105.5), None, 106.0, "open", "reopened: a probe failed; open for 10s"),
        (HALF, Tally(9, 20, 9, last_ok_at=99.0, last_failed_at=100.0), None, 106.0, "half_open", "half-open after 5s"),
        (OPEN, Tally(0, 21, 9, last_ok_at=110.0), None, 110.0, "closed", "closed: a probe succeeded"),  # in one tick
    ],
)
def test_judge(state: BreakerState, now: Tally, before: Tally | None, now_s: float, status: str, reason: str) -> None:
    judged = judge(state, CONFIG, now, before, now_s)
    assert (judged.status, judged.reason) == (status, reason)


def test_the_window_forgets_outcomes_older_than_window_s() -> None:
    state = judge(CLOSED, CONFIG, Tally(0, 3, 3 - 1), Tally(), 100.0)  # 3 outcomes, 2 failed: below min_requests
    assert state.status == "closed"
    later = judge(state, CONFIG, Tally(0, 5, 3), Tally(0, 3, 2), 111.0)  # the first 3 have left the window
    assert later.status == "closed" and sum(n for _, n, _ in later.buckets) == 2
    again = judge(state, CONFIG, Tally(0, 5, 3), Tally(0, 3, 2), 101.0)  # within it: 3 of 5 failed
    assert again.status == "open"


def test_a_reopened_breaker_waits_longer_each_time_up_to_the_cap() -> None:
    config = CONFIG.model_copy(update={"max_cool_down_s": 12.0})
    state = BreakerState(status="half_open", opened_at_s=0.0, cool_down_s=10.0)
    reopened = judge(state, config, Tally(1, 1, 1, last_failed_at=10.5), None, 11.0)
    assert (reopened.status, reopened.cool_down_s, reopened.opened_at_s) == ("open", 12.0, 11.0)
