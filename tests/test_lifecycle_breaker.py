"""The pure circuit breaker, by tables: opening on consecutive failures and on the windowed error rate, the
cool-down, half-open probes (limited, timed out), closing, reopening with a growing capped cool-down, Retry-After,
and config conflicts."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from fleet.lifecycle.breaker import (
    BreakerConfig,
    BreakerState,
    Outcome,
    allow,
    record,
    retry_after_header,
    retry_after_s,
)

CONFIG = BreakerConfig(
    consecutive_failures=3, error_rate=0.5, window_s=10, min_requests=6, cool_down_s=5, max_cool_down_s=18
)
S: Outcome = "success"
F: Outcome = "failure"


def run(outcomes: str, start_s: float = 0.0, every_s: float = 0.1, state: BreakerState | None = None) -> BreakerState:
    """Record outcomes written as 's' and 'f', one per ``every_s``, asking ``allow`` first as a caller would."""
    state = state or BreakerState()
    for i, letter in enumerate(outcomes):
        now = start_s + i * every_s
        allowed, state = allow(state, CONFIG, now)
        if allowed:
            state = record(state, CONFIG, S if letter == "s" else F, now)
    return state


def opened(at_s: float = 0.0) -> BreakerState:
    return BreakerState(status="open", opened_at_s=at_s, cool_down_s=CONFIG.cool_down_s, reason="opened")


# -- closed -> open -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("outcomes", "status", "reason"),
    [
        ("", "closed", "closed"),
        ("ff", "closed", "closed"),
        ("fff", "open", "opened: 3 consecutive failures"),
        ("ffsff", "closed", "closed"),  # a success resets the run; 4 of 5 is under min_requests
        ("fsfsfs", "open", "opened: 3 of 6 requests failed in 10s (50 %, limit 50 %)"),
        ("sfsfss", "closed", "closed"),  # 2 of 6
    ],
    ids=[
        "nothing",
        "two-failures",
        "three-in-a-row",
        "run-broken",
        "rate-at-limit",
        "rate-under",
    ],
)
def test_closed_to_open(outcomes: str, status: str, reason: str) -> None:
    state = run(outcomes)
    assert state.status == status and state.reason.startswith(reason), state.reason


def test_the_error_rate_opens_once_the_window_reaches_it() -> None:
    state = run("sssfsfsfsf")  # 4 of 10 failed: under 50 %, never 3 in a row
    assert state.status == "closed"
    state = run("fsf", start_s=1.0, state=state)  # 6 of 13
    assert state.status == "closed"
    state = run("f", start_s=1.3, state=state)  # 7 of 14, 2 in a row
    assert state.status == "open" and state.reason.startswith("opened: 7 of 14 requests failed"), state.reason


def test_failures_older_than_the_window_do_not_count() -> None:
    state = run("ffsff", start_s=0.0, every_s=1.0)  # 4 failures of 5 at 0..4 s
    state = run("s", start_s=20.0, state=state)  # the window (10 s) has moved past them
    assert state.status == "closed" and sum(n for _, n, _ in state.buckets) == 1
    state = run("fsf", start_s=20.1, state=state)
    assert state.status == "closed"  # 2 of 4 in the window: under min_requests


def test_the_window_state_stays_small() -> None:
    state = run("s" * 5_000, every_s=0.01)
    assert state.status == "closed" and len(state.buckets) <= 10


# -- open, half-open, closed or reopened ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("now_s", "allowed", "status"),
    [(0.0, False, "open"), (4.99, False, "open"), (5.0, True, "half_open"), (60.0, True, "half_open")],
    ids=["just-opened", "before-cool-down", "at-cool-down", "long-after"],
)
def test_open_refuses_until_the_cool_down(now_s: float, allowed: bool, status: str) -> None:
    ok, state = allow(opened(), CONFIG, now_s)
    assert (ok, state.status) == (allowed, status)


def test_half_open_lets_a_limited_number_of_probes_through() -> None:
    config = CONFIG.model_copy(update={"half_open_probes": 2})
    state = opened()
    verdicts = []
    for now in (5.0, 5.1, 5.2, 5.3):
        ok, state = allow(state, config, now)
        verdicts.append(ok)
    assert verdicts == [True, True, False, False]
    assert retry_after_s(state, config, 5.3) == pytest.approx(30 - 0.3)  # the first probe's place frees then
    ok, state = allow(state, config, 35.05)  # the first probe timed out without an outcome, the second not yet
    assert ok and state.probes == (5.1, 35.05)
    ok, state = allow(state, config, 35.06)
    assert not ok


@pytest.mark.parametrize(
    ("outcome", "status", "reason", "cool_down_s"),
    [
        (S, "closed", "closed: a probe succeeded", None),
        (F, "open", "reopened: a probe failed; open for 10s", 10.0),
    ],
    ids=["success-closes", "failure-reopens"],
)
def test_a_probe_decides(outcome: Outcome, status: str, reason: str, cool_down_s: float | None) -> None:
    ok, state = allow(opened(), CONFIG, 5.0)
    assert ok
    state = record(state, CONFIG, outcome, 5.5)
    assert (state.status, state.reason, state.cool_down_s) == (status, reason, cool_down_s)
    if status == "closed":
        assert state.buckets == () and state.consecutive_failures == 0


def test_the_cool_down_grows_with_each_failed_probe_up_to_its_cap_and_resets_on_close() -> None:
    state, now, cool_downs = opened(), 0.0, []
    for _ in range(4):
        now += retry_after_s(state, CONFIG, now)
        ok, state = allow(state, CONFIG, now)
        assert ok and state.status == "half_open"
        state = record(state, CONFIG, F, now)
        cool_downs.append(state.cool_down_s)
    assert cool_downs == [10.0, 18.0, 18.0, 18.0]
    now += 18.0
    _, state = allow(state, CONFIG, now)
    state = record(state, CONFIG, S, now)
    state = run("fff", start_s=now, state=state)
    assert state.status == "open" and state.cool_down_s == 5.0  # back to the first cool-down


def test_an_outcome_recorded_while_open_changes_nothing() -> None:
    state = opened()
    assert record(state, CONFIG, S, 1.0) is state
    assert record(state, CONFIG, F, 1.0) is state


# -- Retry-After ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("state", "now_s", "seconds", "header"),
    [
        (BreakerState(), 0.0, 0.0, "1"),
        (opened(), 0.0, 5.0, "5"),
        (opened(), 3.2, 1.8, "2"),
        (opened(), 9.0, 0.0, "1"),
        (BreakerState(status="half_open", probes=(10.0,)), 12.0, 28.0, "28"),
        (BreakerState(status="half_open", probes=()), 12.0, 0.0, "1"),
    ],
    ids=["closed", "just-opened", "partway", "past-cool-down", "probe-in-flight", "probe-place-free"],
)
def test_retry_after(state: BreakerState, now_s: float, seconds: float, header: str) -> None:
    assert retry_after_s(state, CONFIG, now_s) == pytest.approx(seconds)
    assert retry_after_header(state, CONFIG, now_s) == header


# -- properties -----------------------------------------------------------------------------------------------
@given(st.lists(st.tuples(st.sampled_from([S, F]), st.floats(0.0, 2.0)), max_size=200))
def test_a_request_is_refused_only_while_not_closed(steps: list[tuple[Outcome, float]]) -> None:
    state, now = BreakerState(), 0.0
    for outcome, gap in steps:
        now += gap
        ok, state = allow(state, CONFIG, now)
        if not ok:
            assert state.status != "closed" and retry_after_s(state, CONFIG, now) > 0
        else:
            state = record(state, CONFIG, outcome, now)
        assert state.consecutive_failures < CONFIG.consecutive_failures
        cool_down = state.cool_down_s or CONFIG.cool_down_s
        assert CONFIG.cool_down_s <= cool_down <= CONFIG.max_cool_down_s


# -- config ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"cool_down_s": 60, "max_cool_down_s": 30}, "max_cool_down_s 30.0 is below cool_down_s 60.0"),
        ({"error_rate": 0}, "greater than 0"),
        ({"error_rate": 1.5}, "less than or equal to 1"),
        ({"consecutive_failures": 0}, "greater than or equal to 1"),
        ({"cool_down_factor": 0.5}, "greater than or equal to 1"),
        ({"half_open_probes": 0}, "greater than or equal to 1"),
    ],
    ids=["cap-below-cool-down", "zero-rate", "rate-above-one", "zero-failures", "shrinking-cool-down", "no-probes"],
)
def test_invalid_configs_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        BreakerConfig.model_validate(fields)
