"""The pure batch controller, by tables: each rule, the limits, hysteresis, and a fluid model of a worker under
stepped load where the knobs must settle (no oscillation) with p99 under the target. Also the declarations and
settings that turn it on, and the window that feeds it."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from pydantic import ValidationError

from fleet.consumers.batch_control import (
    BatchLimits,
    ControlState,
    ControlWindow,
    Knobs,
    Observation,
    control,
    initial_state,
)
from fleet.schemas.models import EchoInput, EchoOutput, ModelSpec
from fleet.settings import FleetSettings

LIMITS = BatchLimits(p99_target_ms=100.0, max_batch=64, max_wait_ms=10.0, min_batch=2)


def obs(
    *,
    batches: int = 8,
    mean: float = 8.0,
    full: float = 0.0,
    p99: float = 50.0,
    compute: float = 10.0,
    compute_mean: float | None = None,
    busy: float = 0.5,
) -> Observation:
    return Observation(batches, mean, full, p99, compute, compute if compute_mean is None else compute_mean, busy)


def state(batch: int = 32, wait: float = 5.0, **kw: Any) -> ControlState:
    return ControlState(Knobs(batch, wait), **kw)


# (name, observation, state before, expected knobs after one window)
ONE_WINDOW = [
    ("no batches: no evidence, no change", obs(batches=0, p99=500), state(), Knobs(32, 5.0)),
    ("lone requests: the wait goes to 0", obs(mean=1.0, p99=20, compute=3), state(wait=10), Knobs(32, 0.0)),
    ("over high water with a wait: wait to 0 first", obs(p99=95, compute=60), state(), Knobs(32, 0.0)),
    ("over high water, compute-bound, slack: shrink at once", obs(p99=95, compute=60), state(wait=0), Knobs(22, 0.0)),
    ("a shrink keeps room above the mean batch", obs(p99=95, compute=60, mean=20), state(wait=0), Knobs(25, 0.0)),
    (
        "busy device: no shrink (it would not keep up), the wait is free",
        obs(p99=95, compute=60, busy=0.95),
        state(wait=0),
        Knobs(32, 10.0),
    ),
    ("busy device over high water: the wait stays", obs(p99=95, compute=8, busy=0.95), state(wait=8), Knobs(32, 8.0)),
    ("1.5 to 2 items a batch keep the wait", obs(mean=1.8, compute=6, busy=0.9), state(wait=2), Knobs(32, 2.0)),
    ("no shrink below what arrives", obs(p99=95, compute=60, mean=28), state(wait=0), Knobs(32, 0.0)),
    (
        "over high water and full batches: a grow is pending",
        obs(p99=95, compute=8, mean=16, full=1),
        state(16, 0),
        Knobs(16, 0.0),
    ),
    (
        "headroom and full batches: grow waits for patience",
        obs(p99=20, compute=8, mean=16, full=1),
        state(16, 0),
        Knobs(16, 0.0),
    ),
    ("between the marks: hold", obs(p99=75, compute=20, full=1, mean=32), state(wait=0), Knobs(32, 0.0)),
    (
        "headroom, full, but a grown batch would not fit",
        obs(p99=50, compute=40, mean=32, full=1),
        state(wait=0),
        Knobs(32, 0.0),
    ),
    ("shrinking stops at min_batch", obs(p99=200, compute=90, mean=1.5), state(2, 0), Knobs(2, 0.0)),
    ("busy device, company: the wait follows compute", obs(mean=6, compute=4, busy=0.9), state(wait=0), Knobs(32, 4.0)),
    ("between the busy marks the wait stays", obs(mean=6, compute=4, busy=0.7), state(wait=2), Knobs(32, 2.0)),
    (
        "the wait follows compute up to its limit",
        obs(mean=6, p99=30, compute=40, compute_mean=20, busy=0.9),
        state(wait=0),
        Knobs(32, 10.0),
    ),
    ("a device with slack: no wait, it is pure latency", obs(mean=6, p99=30, compute=8), state(wait=5), Knobs(32, 0.0)),
    ("a small change of the wait is noise", obs(mean=6, compute=5.3, busy=0.9), state(wait=5.0), Knobs(32, 5.0)),
    ("knobs outside the limits are brought inside", obs(batches=0), state(500, 99), Knobs(64, 10.0)),
]


@pytest.mark.parametrize(
    ("observation", "before", "after"), [c[1:] for c in ONE_WINDOW], ids=[c[0] for c in ONE_WINDOW]
)
def test_one_window(observation: Observation, before: ControlState, after: Knobs) -> None:
    knobs, new_state = control(observation, before, LIMITS)
    assert knobs == after
    assert new_state.knobs == knobs


def test_grow_after_patience_then_capped_at_the_limit() -> None:
    s = state(16, 0)
    history = []
    for _ in range(14):
        batch = s.knobs.max_batch
        knobs, s = control(obs(p99=20, compute=2, mean=batch, full=1, compute_mean=0.0), s, LIMITS)
        history.append(knobs.max_batch)
    assert history[:4] == [16, 20, 20, 25], "each grow needs two windows in a row"
    assert max(history) == LIMITS.max_batch and history[-1] == LIMITS.max_batch


def test_an_interrupted_streak_starts_over() -> None:
    grow = obs(p99=20, compute=2, mean=16, full=1)
    calm = obs(p99=70, compute=2, mean=16, full=1)  # between the marks
    s = state(16, 0)
    for observation in [grow, calm] * 6:
        knobs, s = control(observation, s, LIMITS)
    assert knobs.max_batch == 16, "a condition that never holds two windows in a row never acts"


def test_a_shrink_resets_a_pending_grow() -> None:
    s = state(32, 0)
    _, s = control(obs(p99=20, compute=2, mean=32, full=1, compute_mean=0.0), s, LIMITS)
    assert s.pending == "grow" and s.streak == 1
    knobs, s = control(obs(p99=95, compute=60, mean=8), s, LIMITS)
    assert knobs.max_batch == 22 and s.streak == 0


def test_initial_state_is_the_largest_batch_and_no_wait() -> None:
    assert initial_state(LIMITS).knobs == Knobs(64, 0.0)


def fluid(batch_knob: int, wait_ms: float, rate_per_ms: float, a: float, b: float) -> tuple[Observation, bool]:
    """A worker computing ``a + b*n`` ms per batch at an arrival rate, in steady state (fluid approximation):
    a batch takes what arrived during the previous compute, capped by the knob, and the wait is spent while the
    batch before computes (the worker collects ahead), so only a wait longer than compute adds latency. An item
    waits for the batch in flight, then computes in its own. Returns the observation and whether it keeps up."""
    n = 1.0
    for _ in range(100):  # fixed point of n = rate * max(compute(n), wait), capped
        n = min(float(batch_knob), max(1.0, rate_per_ms * max(a + b * n, wait_ms)))
    compute = a + b * n
    keeps_up = n / compute >= rate_per_ms * 0.999
    exposed_wait = max(0.0, wait_ms - compute)
    p99 = (2 * compute + exposed_wait) * (1.0 if keeps_up else 20.0)  # overload: the queue grows without bound
    full = 1.0 if n >= batch_knob else 0.0
    busy = min(1.0, rate_per_ms * compute / n)
    return Observation(8, n, full, p99, compute, compute, busy), keeps_up


def best_fixed(limits: BatchLimits, rate_per_ms: float, a: float, b: float) -> float:
    """The lowest p99 any fixed (max_batch, max_wait_ms) within the limits gives, in the same fluid model."""
    batches = sorted({*range(limits.min_batch, limits.max_batch + 1, 4), limits.max_batch})
    sweep = itertools.product(batches, (0.0, limits.max_wait_ms))
    return min(fluid(batch, wait, rate_per_ms, a, b)[0].p99_ms for batch, wait in sweep)


@pytest.mark.parametrize(
    ("a", "b", "target"),
    [(5.0, 0.5, 80.0), (10.0, 1.0, 150.0), (2.0, 0.1, 30.0), (0.5, 1.0, 60.0)],
    ids=["a5-b0.5", "a10-b1", "a2-b0.1", "no-overhead"],
)
def test_stepped_load_settles_near_the_best_fixed_setting(a: float, b: float, target: float) -> None:
    limits = BatchLimits(p99_target_ms=target, max_batch=256, max_wait_ms=10.0)
    saturation = 256 / (a + b * 256)  # items per ms at the largest batch
    s = initial_state(limits)
    for share in (0.2, 0.9, 0.4):
        rate = share * saturation
        history: list[Knobs] = []
        for _ in range(40):
            observation, _ = fluid(s.knobs.max_batch, s.knobs.max_wait_ms, rate, a, b)
            knobs, s = control(observation, s, limits)
            history.append(knobs)
        last, keeps_up = fluid(s.knobs.max_batch, s.knobs.max_wait_ms, rate, a, b)
        changes = sum(1 for x, y in itertools.pairwise(history[-20:]) if x != y)
        assert changes == 0, f"load {share:.0%}: the knobs still move after 20 windows: {history[-20:]}"
        assert keeps_up, f"load {share:.0%}: {s.knobs} does not keep up"
        best = best_fixed(limits, rate, a, b)
        if best <= target:
            assert last.p99_ms <= target, f"load {share:.0%}: p99 {last.p99_ms:.1f} over {target} with {s.knobs}"
        else:
            assert last.p99_ms <= 1.1 * best, f"load {share:.0%}: p99 {last.p99_ms:.1f}, best fixed {best:.1f}"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"p99_target_ms": -5.0}, "p99_target_ms"), ({"min_batch": 9}, "min_batch"), ({"max_batch_cost": 0}, "cost")],
)
def test_model_declarations_are_checked(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelSpec("m", EchoInput, EchoOutput, max_batch=8, **kwargs)


def test_settings_turn_the_controller_on_off_and_override_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_P99_TARGET_MS", "embed=50, echo=0")
    monkeypatch.setenv("FLEET_MAX_BATCH_COST", '{"embed": 4096}')
    settings = FleetSettings()
    assert settings.p99_target_for("embed", None) == 50.0
    assert settings.p99_target_for("echo", 20.0) is None, "0 turns a declared target off"
    assert settings.p99_target_for("sleep", 30.0) == 30.0, "the model's declaration stands"
    assert settings.max_batch_cost_for("embed", 16384) == 4096
    assert settings.max_batch_cost_for("echo", None) is None
    off = FleetSettings(adaptive_batching=False, p99_target_ms={"embed": 50})
    assert off.p99_target_for("embed", 40.0) is None


@pytest.mark.parametrize(
    ("env", "value"),
    [("FLEET_P99_TARGET_MS", "embed"), ("FLEET_P99_TARGET_MS", "embed=-3"), ("FLEET_MAX_BATCH_COST", "embed=0")],
)
def test_bad_settings_are_refused(monkeypatch: pytest.MonkeyPatch, env: str, value: str) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ValidationError):
        FleetSettings()


def test_window_observes_and_starts_over() -> None:
    window = ControlWindow(min_batches=3, max_span_s=10.0, started_s=0.0)
    assert not window.ready(now_s=0.5)
    for size, compute, latencies in [(4, 10.0, [12.0, 14.0]), (2, 6.0, [30.0]), (8, 20.0, [22.0])]:
        window.fetched(closed_full=size == 8)
        window.computed(size, compute, latencies)
    assert window.ready(now_s=0.5)
    observation = window.observe(now_s=1.0)
    assert observation == Observation(3, 14 / 3, 1 / 3, 30.0, 20.0, 12.0, busy_share=0.036)
    assert not window.ready(now_s=1.5) and window.observe(now_s=2.0).batches == 0
    window.computed(1, 1.0, [1.0])
    assert not window.ready(now_s=5.0) and window.ready(now_s=12.0), "one batch is enough once the time is up"
