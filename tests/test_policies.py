"""Table tests of the pure dispatch policies and of the per-dispatcher state they read."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from fleet.dispatcher.policies import (
    POLICIES,
    POLICY_NAMES,
    JiqAmnesiaPolicy,
    LeastOutstandingPolicy,
    PeakEwmaPolicy,
    PowerOfDPolicy,
    RoundRobinPolicy,
    announce_to,
    make_policy,
)
from fleet.dispatcher.state import Bag, DispatcherState


def state_with(*workers: str, window: float = 10.0) -> DispatcherState[str]:
    state: DispatcherState[str] = DispatcherState(amnesia_window_s=window)
    for worker in workers:
        state.add_worker(worker)
    return state


def busy(state: DispatcherState[str], worker: str, jobs: int, now: float = 0.0) -> None:
    for _ in range(jobs):
        state.on_assign(worker, now)


# -- DispatcherState -------------------------------------------------------------------------------------------


def test_an_idle_token_is_used_once() -> None:
    state = state_with("a")
    assert state.add_token("a", 1)
    assert state.idle_length == 1
    assert state.pop_token() == ("a", 1)
    assert state.pop_token() is None
    assert state.idle_length == 0


def test_a_repeated_token_is_not_queued_twice() -> None:
    state = state_with("a")
    assert state.add_token("a", 1)
    assert not state.add_token("a", 1)
    assert state.pop_token() == ("a", 1)
    assert state.pop_token() is None


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        # a newer token makes the older one stale: the worker is offered once, with its newest token
        ([("token", "a", 1), ("token", "b", 2), ("token", "a", 3)], [("b", 2), ("a", 3)]),
        # a retracted token is skipped; a retraction of an older sequence number does nothing
        ([("token", "a", 1), ("token", "b", 2), ("retract", "a", 1), ("retract", "b", 0)], [("b", 2)]),
        # a dead worker's token is dropped, and a dead worker cannot announce
        ([("token", "a", 1), ("token", "b", 2), ("dead", "a", 0), ("token", "a", 3)], [("b", 2)]),
        # tokens come out in arrival order
        ([("token", "c", 5), ("token", "a", 6), ("token", "b", 7)], [("c", 5), ("a", 6), ("b", 7)]),
    ],
)
def test_stale_retracted_and_dead_tokens_are_dropped(
    events: list[tuple[str, str, int]], expected: list[tuple[str, int]]
) -> None:
    state = state_with("a", "b", "c")
    for kind, worker, seq in events:
        if kind == "token":
            state.add_token(worker, seq)
        elif kind == "retract":
            state.retract(worker, seq)
        else:
            state.remove_worker(worker)
    assert state.idle_length == len(expected)
    popped = []
    while (token := state.pop_token()) is not None:
        popped.append(token)
    assert popped == expected


def test_outstanding_counts_follow_assignments_completions_and_abandons() -> None:
    state = state_with("a")
    busy(state, "a", 3)
    state.on_complete("a", 2.0, now=2.0)
    state.on_abandon("a")
    view = state.views["a"]
    assert (view.outstanding, view.assigned, view.completed) == (1, 3, 1)
    assert view.ewma_s == 2.0 and view.peak_s == 2.0


def test_the_latency_ewma_moves_towards_new_samples_and_the_peak_jumps_up() -> None:
    state = state_with("a")
    for latency in (1.0, 1.0, 5.0):
        state.on_assign("a", 0.0)
        state.on_complete("a", latency, now=latency)
    view = state.views["a"]
    assert 1.0 < view.ewma_s < 5.0
    assert view.peak_s == 5.0


def test_amnesia_entries_are_forgotten_after_the_window() -> None:
    state = state_with("a", "b", window=10.0)
    state.on_complete("a", 1.0, now=0.0)
    state.on_complete("b", 1.0, now=8.0)
    rng = random.Random(1)
    assert {v.worker for v in state.sample_amnesia(2, now=5.0, rng=rng)} == {"a", "b"}
    assert {v.worker for v in state.sample_amnesia(2, now=15.0, rng=rng)} == {"b"}
    assert "a" not in state.amnesia
    assert state.sample_amnesia(2, now=30.0, rng=rng) == []
    assert len(state.amnesia) == 0


def test_a_dead_worker_leaves_the_amnesia_list() -> None:
    state = state_with("a")
    state.on_complete("a", 1.0, now=0.0)
    state.remove_worker("a")
    assert state.sample_amnesia(2, now=1.0, rng=random.Random(1)) == []


def test_the_bag_samples_uniformly_and_survives_removals() -> None:
    bag: Bag[int] = Bag()
    for i in range(10):
        bag.add(i)
    bag.add(3)
    for i in (0, 5, 9):
        bag.discard(i)
    bag.discard(42)
    assert sorted(bag) == [1, 2, 3, 4, 6, 7, 8] and len(bag) == 7
    rng = random.Random(7)
    counts = Counter(bag.choice(rng) for _ in range(7000))
    assert set(counts) == set(bag)
    assert all(800 < n < 1200 for n in counts.values()), counts


# -- policies --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(POLICIES))
def test_a_dead_worker_is_never_chosen(name: str) -> None:
    state = state_with("a", "b", "c", "d")
    for seq, worker in enumerate(("b", "a", "c", "d"), start=1):
        state.add_token(worker, seq)
        state.on_complete(worker, 0.1 if worker == "b" else 1.0, now=0.0)  # b looks best to every policy
    state.remove_worker("b")
    policy, rng = make_policy(name), random.Random(3)
    chosen = set()
    for step in range(200):
        choice = policy.choose(state, 1.0 + step, rng)
        assert choice is not None
        chosen.add(choice.worker)
        state.on_assign(choice.worker, 1.0 + step)
    assert "b" not in chosen and chosen <= {"a", "c", "d"}


@pytest.mark.parametrize("name", list(POLICIES))
def test_no_live_worker_means_no_choice(name: str) -> None:
    state = state_with("a")
    state.remove_worker("a")
    assert make_policy(name).choose(state, 0.0, random.Random(1)) is None


@pytest.mark.parametrize("name", ["jiq-random", "jiq-sq", "jiq-amnesia"])
def test_jiq_uses_idle_tokens_first_in_order_then_falls_back(name: str) -> None:
    state = state_with("a", "b", "c")
    state.add_token("c", 7)
    state.add_token("a", 8)
    policy, rng = make_policy(name), random.Random(1)
    first, second = policy.choose(state, 0.0, rng), policy.choose(state, 0.0, rng)
    assert first is not None and (first.worker, first.route, first.token) == ("c", "idle", 7)
    assert second is not None and (second.worker, second.route, second.token) == ("a", "idle", 8)
    third = policy.choose(state, 0.0, rng)
    assert third is not None and third.route == "fallback" and third.token is None  # nothing on the amnesia list


def test_jiq_amnesia_falls_back_to_the_lowest_latency_recent_worker() -> None:
    state = state_with("fast", "slow", "never")
    state.on_complete("slow", 3.0, now=0.0)
    state.on_complete("fast", 1.0, now=0.0)
    choice = JiqAmnesiaPolicy(d=2).choose(state, 5.0, random.Random(1))
    assert choice is not None and (choice.worker, choice.route) == ("fast", "amnesia")


def test_jiq_amnesia_passes_over_a_worker_it_has_just_chosen() -> None:
    state = state_with("fast", "slow")
    state.on_complete("fast", 1.0, now=0.0)
    state.on_complete("slow", 2.0, now=0.0)
    policy, rng = JiqAmnesiaPolicy(d=2), random.Random(5)
    picks = []
    for now in (5.0, 5.1, 5.2, 6.3):
        choice = policy.choose(state, now, rng)
        assert choice is not None
        picks.append(choice.worker)
        state.on_assign(choice.worker, now)
    # fast first; within its own latency (1.0) it is passed over for slow, even once slow was just chosen too
    # (then both are "busy" and the lowest latency wins again); 1.1 later fast is rested and chosen
    assert picks == ["fast", "slow", "fast", "fast"]


@pytest.mark.parametrize("n", [1, 2, 5])
def test_round_robin_visits_every_live_worker_in_turn(n: int) -> None:
    workers = [f"w{i}" for i in range(n)]
    state, policy, rng = state_with(*workers), RoundRobinPolicy(), random.Random(2)
    rounds = [policy.choose(state, 0.0, rng) for _ in range(3 * n)]
    names = [c.worker for c in rounds if c is not None]
    assert Counter(names) == dict.fromkeys(workers, 3)
    assert names[:n] == names[n : 2 * n]  # the same order every round


def test_round_robin_dispatchers_start_at_different_workers() -> None:
    state, rng = state_with(*(f"w{i}" for i in range(100))), random.Random(4)
    starts = {RoundRobinPolicy().choose(state, 0.0, rng).worker for _ in range(10)}  # type: ignore[union-attr]
    assert len(starts) > 5


@pytest.mark.parametrize(
    ("outstanding", "expected"),
    [
        ({"a": 3, "b": 1, "c": 2}, "b"),
        ({"a": 0, "b": 1, "c": 2}, "a"),
        ({"a": 4, "b": 4, "c": 0}, "c"),
    ],
)
def test_least_outstanding_and_power_of_d_pick_the_least_loaded(outstanding: dict[str, int], expected: str) -> None:
    for seed in range(20):
        state = state_with(*outstanding)
        for worker, jobs in outstanding.items():
            busy(state, worker, jobs)
        rng = random.Random(seed)
        for policy in (LeastOutstandingPolicy(), PowerOfDPolicy(d=3), PowerOfDPolicy(d=5)):
            choice = policy.choose(state, 0.0, rng)
            assert choice is not None and choice.worker == expected, (policy, seed)


def test_power_of_two_never_picks_the_most_loaded_of_its_pair() -> None:
    state = state_with(*(f"w{i}" for i in range(10)))
    for i in range(10):
        busy(state, f"w{i}", i)
    rng, policy = random.Random(9), PowerOfDPolicy(d=2)
    picks = Counter(policy.choose(state, 0.0, rng).worker for _ in range(2000))  # type: ignore[union-attr]
    assert "w9" not in picks
    assert picks["w0"] > picks["w5"] > picks["w8"]  # w0 wins every pair it is in: 2/10 of all choices
    assert 300 < picks["w0"] < 500


def test_peak_ewma_prefers_low_latency_times_load_and_tries_unmeasured_workers() -> None:
    state = state_with("fast", "slow")
    state.on_complete("fast", 1.0, now=0.0)
    state.on_complete("slow", 4.0, now=0.0)
    rng = random.Random(1)
    assert PeakEwmaPolicy(d=2).choose(state, 1.0, rng).worker == "fast"  # type: ignore[union-attr]
    busy(state, "fast", 4)  # 1.0 x 5 > 4.0 x 1
    assert PeakEwmaPolicy(d=2).choose(state, 1.0, rng).worker == "slow"  # type: ignore[union-attr]
    state.add_worker("new")
    assert PeakEwmaPolicy(d=3).choose(state, 1.0, rng).worker == "new"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("name", "announce"),
    [("random", "none"), ("power-of-d", "none"), ("jiq-random", "random"), ("jiq-sq", "sq"), ("jiq-amnesia", "sq")],
)
def test_each_policy_says_how_workers_announce(name: str, announce: str) -> None:
    policy = make_policy(name, d=3)
    assert (policy.name, policy.announce, policy.d) == (name, announce, 3)


@pytest.mark.parametrize(("name", "message"), [("nope", "unknown policy 'nope'"), ("pull", "pull has no dispatcher")])
def test_make_policy_refuses_unknown_names(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        make_policy(name)
    assert all(known in str(raised.value) for known in POLICY_NAMES)


# -- announce_to -----------------------------------------------------------------------------------------------


def shares(lengths: list[int], rule: str, d: int, trials: int = 3000) -> list[float]:
    rng = random.Random(11)
    counts = Counter(announce_to(lengths, rule, d, rng) for _ in range(trials))  # type: ignore[arg-type]
    return [counts[i] / trials for i in range(len(lengths))]


def test_announce_sq_prefers_the_shortest_idle_queue() -> None:
    sq, uniform = shares([5, 0, 7], "sq", 2), shares([5, 0, 7], "random", 2)
    assert sq[1] > 0.5 > sq[0] > sq[2]  # SQ(2): the empty queue wins every pair it is sampled in
    assert all(0.28 < s < 0.39 for s in uniform)
    assert shares([9, 0], "sq", 2)[1] >= 0.7
    assert shares([9, 0, 9, 9, 9], "sq", 5)[1] >= 0.6  # sampled in most of 5 draws, and then it always wins


def test_announce_with_one_dispatcher_is_that_one() -> None:
    assert {announce_to([3], rule, 2, random.Random(s)) for s in range(5) for rule in ("sq", "random")} == {0}


# -- jiq-sed: JIQ with a shortest-expected-delay check --------------------------------------------------------


def measured(state: DispatcherState[str], **service_s: float) -> None:
    """Give each worker a service-time estimate: one completion of that latency, nothing outstanding."""
    for worker, latency in service_s.items():
        state.on_assign(worker, 0.0)
        state.on_complete(worker, latency, now=0.0)


def test_peeking_at_tokens_uses_none_and_taking_one_uses_exactly_that_one() -> None:
    state = state_with("a", "b", "c")
    for seq, worker in enumerate("abc", start=1):
        state.add_token(worker, seq)
    state.retract("a", 1)
    assert state.peek_tokens(5) == [("b", 2), ("c", 3)]
    assert state.idle_length == 2
    assert state.take_token("c", 3) and not state.take_token("c", 3)
    assert state.peek_tokens(5) == [("b", 2)]
    assert state.pop_token() == ("b", 2) and state.pop_token() is None


def test_jiq_sed_prefers_a_fast_idle_worker_to_a_slow_one_queued_before_it() -> None:
    state = state_with("slow", "fast")
    measured(state, slow=3.0, fast=1.0)
    state.add_token("slow", 1)
    state.add_token("fast", 2)
    choice = make_policy("jiq-sed").choose(state, 1.0, random.Random(1))
    assert choice is not None and (choice.worker, choice.route, choice.token) == ("fast", "idle", 2)
    assert state.peek_tokens(5) == [("slow", 1)], "the slow worker's token is still there for later"


@pytest.mark.parametrize(
    ("fast_outstanding", "expected"),
    [
        (0, ("fast", "amnesia")),  # presumed busy with one job: done after 2 x 1.0, sooner than the slow one's 3.0
        (1, ("slow", "idle")),  # one more job of ours there: 3 x 1.0 is not sooner than 3.0
    ],
)
def test_jiq_sed_weighs_a_busy_fast_worker_against_an_idle_slow_one(
    fast_outstanding: int, expected: tuple[str, str]
) -> None:
    state = state_with("slow", "fast")
    measured(state, slow=3.0, fast=1.0)
    busy(state, "fast", fast_outstanding)
    state.add_token("slow", 1)
    choice = make_policy("jiq-sed").choose(state, 1.0, random.Random(1))
    assert choice is not None and (choice.worker, choice.route) == expected
