"""Affinity routing, pure: which worker a request for a model version goes to (tables), the loaded-versions
bookkeeping, the wait budget, and the simulator showing the cold loads it avoids."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace

import pytest

from fleet import constants as c
from fleet.dispatcher.affinity import LoadedVersions, choose, expected_wait_s, wait_budget_s
from fleet.dispatcher.policies import make_policy
from fleet.dispatcher.service import RequestFacts, request_facts
from fleet.dispatcher.sim_affinity import AffinitySimConfig, simulate_affinity
from fleet.dispatcher.state import DispatcherState


def fleet(
    loaded: dict[str, list[str]],
    *,
    tokens: tuple[str, ...] = (),
    busy: dict[str, tuple[float, int]] | None = None,
) -> tuple[DispatcherState[str], LoadedVersions[str]]:
    """Workers with their loaded versions; ``tokens``: the idle ones, in queue order; ``busy``: worker ->
    (service time, jobs outstanding here)."""
    state: DispatcherState[str] = DispatcherState()
    versions: LoadedVersions[str] = LoadedVersions()
    for worker, names in loaded.items():
        state.add_worker(worker)
        versions.report(worker, names, now=0.0)
    for seq, worker in enumerate(tokens, 1):
        state.add_token(worker, seq)
    for worker, (service_s, outstanding) in (busy or {}).items():
        state.on_assign(worker, 0.0)
        state.on_complete(worker, service_s, 0.0)  # one measured job sets the service time
        for _ in range(outstanding):
            state.on_assign(worker, 0.0)
    return state, versions


CASES = [
    # (what, loaded, idle tokens, busy (service s, outstanding), version, budget s, expected (worker, route, cold))
    (
        "an idle warm worker beats an idle cold one ahead of it in the idle queue",
        {"a": ["1"], "b": ["2"]},
        ("a", "b"),
        {},
        "2",
        1.0,
        ("b", "idle", False),
    ),
    (
        "a busy warm worker that starts the job within the budget beats an idle cold worker",
        {"a": ["1"], "b": ["2"]},
        ("a",),
        {"b": (0.2, 1)},  # starts it in 0.2 x 2 = 0.4 s
        "2",
        1.0,
        ("b", "warm", False),
    ),
    (
        "past the budget the idle cold worker takes it (a cold load)",
        {"a": ["1"], "b": ["2"]},
        ("a",),
        {"b": (0.2, 9)},  # 0.2 x 10 = 2 s
        "2",
        1.0,
        ("a", "idle", True),
    ),
    (
        "the warm worker expected to start it soonest",
        {"a": ["2"], "b": ["2"], "c": ["1"]},
        ("c",),
        {"a": (0.3, 2), "b": (0.1, 3)},  # a: 0.9 s, b: 0.4 s
        "2",
        1.0,
        ("b", "warm", False),
    ),
    (
        "with no idle worker anywhere a busy warm one still wins, past its budget: a cold one is busy too",
        {"a": ["1"], "b": ["2"]},
        (),
        {"a": (0.2, 0), "b": (0.2, 50)},
        "2",
        1.0,
        ("b", "warm", False),
    ),
    (
        "budget 0 still takes an idle warm worker",
        {"a": ["1"], "b": ["2"]},
        ("a", "b"),
        {},
        "2",
        0.0,
        ("b", "idle", False),
    ),
    (
        "budget 0 never queues behind a busy warm worker while a cold one is idle",
        {"a": ["1"], "b": ["2"]},
        ("a",),
        {"b": (0.01, 0)},
        "2",
        0.0,
        ("a", "idle", True),
    ),
    (
        "a version warm nowhere: the policy's choice, a cold load",
        {"a": ["1"], "b": ["1"]},
        ("b",),
        {},
        "3",
        5.0,
        ("b", "idle", True),
    ),
    (
        "no version (the default): warm on a worker with any version loaded",
        {"a": [], "b": ["7"]},
        ("a", "b"),
        {},
        None,
        1.0,
        ("b", "idle", False),
    ),
    (
        "workers that report nothing loaded (one model, loaded at start): the policy decides as without affinity",
        {"a": [], "b": []},
        ("b", "a"),
        {},
        None,
        1.0,
        ("b", "idle", True),
    ),
    (
        "a never-measured warm worker is expected to start at once",
        {"a": ["1"], "b": ["2"]},
        ("a",),
        {},
        "2",
        0.0,
        ("b", "warm", False),
    ),
]


@pytest.mark.parametrize(
    ("loaded", "tokens", "busy", "version", "budget_s", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_choice(loaded, tokens, busy, version, budget_s, expected) -> None:
    state, versions = fleet(loaded, tokens=tokens, busy=busy)
    choice = choose(make_policy("jiq-amnesia"), state, versions, version, budget_s, 1.0, random.Random(3))
    assert choice is not None
    assert (choice.worker, choice.route, choice.cold) == expected
    if choice.route == "idle":
        assert not state.has_token(choice.worker), "an idle token is used once"


def test_a_dead_warm_worker_is_never_chosen() -> None:
    state, versions = fleet({"a": ["1"], "b": ["2"]}, tokens=("a",))
    state.remove_worker("b")  # its heartbeats stopped; the loaded list has not caught up yet
    choice = choose(make_policy("jiq-amnesia"), state, versions, "2", 10.0, 1.0, random.Random(1))
    assert choice is not None and (choice.worker, choice.cold) == ("a", True)


def test_no_live_worker_is_no_choice() -> None:
    state, versions = fleet({})
    assert choose(make_policy("jiq-amnesia"), state, versions, "1", 1.0, 0.0, random.Random(1)) is None


def test_warm_choices_spread_over_equal_warm_workers() -> None:
    state, versions = fleet({w: ["1"] for w in "abcd"})
    policy = make_policy("round-robin")
    choices = [choose(policy, state, versions, "1", 1.0, 0.0, random.Random(seed)) for seed in range(40)]
    assert {choice.worker for choice in choices if choice is not None} == set("abcd")


# -- LoadedVersions ---------------------------------------------------------------------------------------------
def test_a_heartbeat_replaces_what_a_worker_has_loaded() -> None:
    versions: LoadedVersions[str] = LoadedVersions()
    versions.report("a", ["1", "2"], now=0.0)
    versions.report("a", ["2"], now=1.0)  # 1 was evicted
    assert not versions.is_warm("a", "1") and versions.is_warm("a", "2") and versions.is_warm("a", None)
    versions.report("a", [], now=2.0)
    assert not versions.is_warm("a", None) and len(versions.warm("2")) == 0


def test_a_cold_assignment_counts_as_loading_until_a_heartbeat_lists_it_or_its_grace_lapses() -> None:
    versions: LoadedVersions[str] = LoadedVersions(load_grace_s=5.0)
    versions.report("a", ["1"], now=0.0)
    versions.on_assign("a", "2", now=1.0)
    assert versions.is_warm("a", "2"), "no second cold load elsewhere while this one loads"
    versions.report("a", ["1"], now=3.0)  # a heartbeat sent before the load finished
    assert versions.is_warm("a", "2")
    versions.report("a", ["1"], now=6.5)  # 5.5 s later still not loaded: the load failed or it was evicted
    assert not versions.is_warm("a", "2") and versions.is_warm("a", "1")
    versions.on_assign("a", "3", now=7.0)
    versions.report("a", ["1", "3"], now=8.0)
    versions.report("a", ["1"], now=9.0)  # listed once, then not: evicted, not loading
    assert not versions.is_warm("a", "3")


def test_a_gone_worker_is_warm_for_nothing() -> None:
    versions: LoadedVersions[str] = LoadedVersions()
    versions.report("a", ["1"], now=0.0)
    versions.on_assign("a", "2", now=0.0)
    versions.forget("a")
    assert versions.versions("a") == frozenset() and not versions.is_warm("a", None)


@pytest.mark.parametrize(
    ("setting_s", "deadline", "now", "expected"),
    [
        (2.0, None, 100.0, 2.0),
        (2.0, 101.0, 100.0, 1.0),  # the deadline is nearer than the setting
        (2.0, 150.0, 100.0, 2.0),
        (2.0, 99.0, 100.0, 0.0),  # already past: no wait at all
        (0.0, 150.0, 100.0, 0.0),
    ],
)
def test_wait_budget(setting_s: float, deadline: float | None, now: float, expected: float) -> None:
    assert wait_budget_s(setting_s, deadline, now) == expected


def test_expected_wait_counts_the_job_presumed_running() -> None:
    state, _ = fleet({"a": []}, busy={"a": (0.5, 3)})
    assert expected_wait_s(state.views["a"]) == pytest.approx(2.0)


# -- simulation -------------------------------------------------------------------------------------------------
def test_simulated_affinity_avoids_cold_loads_and_cuts_the_tail() -> None:
    """8 workers holding 2 of 8 Zipf-popular versions each, a load costing 5 service times: the policy alone
    reloads on more than half of the jobs (and the loads overload the fleet); affinity on under 1 in 100."""
    base = AffinitySimConfig(servers=8, capacity=2, versions=8, load=0.3, load_time=5.0, wait_budget=5.0, jobs=20_000)
    plain = simulate_affinity(replace(base, affinity=False))
    affine = simulate_affinity(base)
    assert plain.cold_per_1000 > 400, plain.cold_per_1000
    assert affine.cold_per_1000 < 10, affine.cold_per_1000
    assert affine.warm_routes > 0, "busy warm workers were preferred to idle cold ones"
    assert affine.quantile(0.99) < plain.quantile(0.99) / 10


def test_a_zero_budget_loads_more_than_a_budget_of_one_load() -> None:
    """The budget is the knob: waiting up to one load's time for a warm worker avoids most of the loads that
    never waiting makes."""
    base = AffinitySimConfig(load=0.5, load_time=5.0, jobs=20_000)
    never = simulate_affinity(replace(base, wait_budget=0.0))
    patient = simulate_affinity(replace(base, wait_budget=5.0))
    assert patient.cold_per_1000 * 5 < never.cold_per_1000, (patient.cold_per_1000, never.cold_per_1000)


# -- what the dispatcher reads from a raw request -----------------------------------------------------------------
@dataclass
class RawRequest:
    """The fields of a delivered message that ``request_facts`` reads."""

    data: bytes
    headers: dict[str, str] = field(default_factory=dict)
    msg_id: str | None = None


@pytest.mark.parametrize(
    ("body", "headers", "expected"),
    [
        ({"job_id": "j1", "version": "2", "deadline": 1234.5}, {}, RequestFacts("j1", "2", 1234.5)),
        ({"job_id": "j1", "version": "2"}, {c.HEADER_VERSION: "3"}, RequestFacts("j1", "3", None)),  # header first
        ({"job_id": "j1"}, {}, RequestFacts("j1", None, None)),  # the default version
        # hostile values are ignored (the worker refuses the body with the parser's reason)
        ({"job_id": "j1", "version": "../../etc"}, {}, RequestFacts("j1", None, None)),
        ({"job_id": "j1"}, {c.HEADER_VERSION: "V" * 5000}, RequestFacts("j1", None, None)),
        ({"job_id": "j1", "version": ["2"], "deadline": True}, {}, RequestFacts("j1", None, None)),
        ({"job_id": "j1", "version": 2, "deadline": "soon"}, {}, RequestFacts("j1", None, None)),
        ([1, 2, 3], {c.HEADER_JOB_ID: "j2", c.HEADER_VERSION: "7"}, RequestFacts("j2", "7", None)),
    ],
)
def test_request_facts(body: object, headers: dict[str, str], expected: RequestFacts) -> None:
    assert request_facts(RawRequest(json.dumps(body).encode(), headers)) == expected  # type: ignore[arg-type]


def test_request_facts_of_bytes_that_are_not_json() -> None:
    raw = RawRequest(b"\xff\xfe not json", {c.HEADER_VERSION: "1"}, msg_id="m-1")
    assert request_facts(raw) == RequestFacts("m-1", "1", None)  # type: ignore[arg-type]
