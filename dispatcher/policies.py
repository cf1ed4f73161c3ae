"""Load-balancing policies: pure choices over a ``DispatcherState``, shared by the live dispatcher and ``fleet sim``.

Every policy answers one question, ``choose(state, now, rng) -> Choice | None``: which live worker gets the next
request (``None`` only when no worker is live). Policies do no I/O and read no clock; the caller records the
assignment (``state.on_assign``) and later the completion (``state.on_complete``).

JIQ policies also tell the *workers* where to announce themselves idle (``announce``): to a random dispatcher
(JIQ-Random) or to the one with the shortest idle queue among ``d`` sampled (JIQ-SQ(d)); ``announce_to`` is that
rule, used by the live worker and the simulated one alike.

=================  =======================================================================================
``random``         a uniformly random live worker
``round-robin``    live workers in turn
``power-of-d``     the fewest outstanding (this dispatcher's count) of ``d`` sampled
``least-outstanding``  the fewest outstanding of all live workers
``peak-ewma``      of ``d`` sampled, the lowest peak-latency EWMA x (outstanding + 1) (Finagle's P2C + peak EWMA)
``jiq-random``     first valid idle token, else random; workers announce to a random dispatcher
``jiq-sq``         first valid idle token, else random; workers announce to the shortest of ``d`` idle queues
``jiq-amnesia``    first valid idle token, else the lowest-latency of ``d`` sampled from the amnesia list,
                   passing over a worker chosen within its own latency (anti-herding), else random;
                   workers announce to the shortest of ``d`` idle queues
``jiq-sed``        JIQ for unequal workers: of the first few idle tokens and ``d`` amnesia-list workers, the one
                   expected to finish the request first (service-time estimate x (outstanding + 1))
``pull``           not a dispatcher policy: workers compete on the broker (the baseline; simulated as one
                   central FIFO queue)
=================  =======================================================================================
"""

from __future__ import annotations

import random
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

from fleet import constants as c
from fleet.dispatcher.state import DispatcherState, WorkerView
from fleet.routing import Announce, announce_to

W = TypeVar("W", bound=Hashable)

Route = Literal["idle", "amnesia", "fallback", "policy", "warm"]


@dataclass(frozen=True, slots=True)
class Choice(Generic[W]):
    """Where a request goes and why: ``token`` is the idle token used (``route == "idle"``), else ``None``;
    ``cold``: the worker does not have the request's model version loaded (``fleet.dispatcher.affinity``)."""

    worker: W
    route: Route
    token: int | None = None
    cold: bool = False


class Policy(Protocol):
    name: str
    announce: Announce  # how workers pick the dispatcher to announce idle to ("none": they do not announce)
    d: int

    def choose(self, state: DispatcherState, now: float, rng: random.Random) -> Choice | None: ...


def _random(state: DispatcherState, rng: random.Random) -> Choice | None:
    return Choice(state.live.choice(rng), "fallback") if len(state.live) else None


def _sample(state: DispatcherState, d: int, rng: random.Random) -> list[WorkerView]:
    live, views = state.live, state.views
    n = len(live)
    if n <= d:
        return [views[w] for w in live]
    return [views[live.at(i)] for i in rng.sample(range(n), d)]


@dataclass(slots=True)
class RandomPolicy:
    name: str = "random"
    announce: Announce = "none"
    d: int = 1

    def choose(self, state: DispatcherState, now: float, rng: random.Random) -> Choice | None:
        return Choice(state.live.choice(rng), "policy") if len(state.live) else None


@dataclass(slots=True)
class RoundRobinPolicy:
    name: str = "round-robin"
    announce: Announce = "none"
    d: int = 1
    _next: int = -1  # -1: not started

    def choose(self, state: DispatcherState, now: float, rng: random.Random) -> Choice | None:
        n = len(state.live)
        if not n:
            return None
        # Each dispatcher starts at a random worker: started in step, m dispatchers would send their requests to
        # the same few workers at the same time.
        self._next = int(rng.random() * n) if self._next < 0 else (self._next + 1) % n
        return Choice(state.live.at(self._next), "policy")


@dataclass(slots=True)
class PowerOfDPolicy:
    """The cheapest of ``d`` sampled live workers; the cost here is this dispatcher's outstanding count."""

    name: str = "power-of-d"
    announce: Announce = "none"
    d: int = 2

    def choose(self, state: DispatcherState, now: float, rng: random.Random) -> Choice | None:
        sampled = _sample(state, self.d, rng)
        return Choice(min(sampled, key=self.cost).worker, "policy") if sampled else None

    @staticmethod
    def cost(view: WorkerView) -> float:
        return view.outstanding


@dataclass(slots=True)
class LeastOutstandingPolicy:
    name: str = "least-outstanding"
    announce: Announce = "none"
    d: int = 1

    def choose(self, state: DispatcherState, now: float, rng: random.Random) -> Choice | None:
        live, views = state.live, state.views
        n = len(live)
        if not n:
            return None
        start = int(rng.random() * n)  # ties go to a random worker, not always the first
        best = views[live.at(start)]
        if best.outstanding:  # an idle worker cannot be beaten: stop scanning at the first one
            for i in range(1, n):
                view = views[live.at((start + i) % n)]
                if view.outstanding < best.outstanding:
                    best = view
                    if not view.outstanding:
                        break
        return Choice(best.worker, "policy")


@dataclass(slots=True)
class PeakEwmaPolicy(PowerOfDPolicy):
    """Power of d with Finagle's cost: peak latency EWMA x (outstanding + 1); a worker never measured costs 0, so
    new workers are tried at once."""

    name: str = "peak-ewma"

    @staticmethod
    def cost(view: WorkerView) -> float:
        return view.peak_s * (view.outstanding + 1)


@dataclass(slots=True)
class JiqPolicy:
    """Join-Idle-Queue (Lu et al. 2011): use an idle token when there is one, else fall back to random."""

    name: str = "jiq-random"
    announce: Announce = "random"
    d: int = 2

    def choose(self, state: DispatcherState, now: float, rng: random.Random) -> Choice | None:
        token = state.pop_token()
        if token is not None:
            return Choice(token[0], "idle", token[1])
        return self.fallback(state, now, rng)

    def fallback(self, state: DispatcherState, now: float, rng: random.Random) -> Choice | None:
        return _random(state, rng)


@dataclass(slots=True)
class JiqAmnesiaPolicy(JiqPolicy):
    """JIQ whose fallback is the amnesia list: the lowest latency EWMA of ``d`` recently active workers, passing
    over one this dispatcher chose less than its own latency ago (it is probably still busy with that job), so
    that dispatchers falling back at the same moment do not all land on the single fastest worker."""

    name: str = "jiq-amnesia"
    announce: Announce = "sq"
    d: int = 2

    def fallback(self, state: DispatcherState, now: float, rng: random.Random) -> Choice | None:
        sampled = state.sample_amnesia(self.d, now, rng)
        if not sampled:
            return _random(state, rng)
        rested = [v for v in sampled if now - v.chosen_at >= v.ewma_s] or sampled
        return Choice(min(rested, key=lambda v: (v.ewma_s, v.outstanding)).worker, "amnesia")


@dataclass(slots=True)
class JiqSedPolicy(JiqAmnesiaPolicy):
    """JIQ with a shortest-expected-delay check, for fleets of unequal workers.

    Plain JIQ sends a request to the first idle worker even when that worker is three times slower than a busy one
    that will be free sooner. Here the dispatcher looks at the first ``TOKENS_SEEN`` idle tokens and at ``d``
    workers from the amnesia list, and estimates each one's completion time from its service-time estimate (the
    floor EWMA of its latency): an idle worker finishes after one service time, a worker without a token after
    ``outstanding + 2`` (the jobs this dispatcher gave it, the one it is presumably running, and this one).
    The cheapest wins; an idle token is used only when its worker wins. Unmeasured workers cost 0, so they are tried.
    """

    name: str = "jiq-sed"
    announce: Announce = "sq"
    d: int = 2
    TOKENS_SEEN = 16

    @staticmethod
    def busy_cost(view: WorkerView) -> float:
        """Expected completion of a job sent to a worker without a token: its own jobs, one running, this one."""
        return view.floor_s * (view.outstanding + 2)

    def choose(self, state: DispatcherState, now: float, rng: random.Random) -> Choice | None:
        views = state.views
        best_token: tuple[Any, int] | None = None
        best_cost = float("inf")
        for worker, seq in state.peek_tokens(self.TOKENS_SEEN):
            cost = views[worker].floor_s
            if cost < best_cost:
                best_token, best_cost = (worker, seq), cost
        # A worker without a token is presumed busy with one job (ours or another dispatcher's) besides the ones
        # this dispatcher knows it holds: with many dispatchers our own count alone says "idle" far too often.
        busy = [
            v
            for v in state.sample_amnesia(self.d, now, rng)
            if state.is_live(v.worker) and not state.has_token(v.worker)
        ]
        if busy:
            view = min(busy, key=self.busy_cost)  # ties keep the sample's (random) order
            if self.busy_cost(view) < best_cost:
                return Choice(view.worker, "amnesia")
        if best_token is not None and state.take_token(*best_token):
            return Choice(best_token[0], "idle", best_token[1])
        return _random(state, rng)


POLICIES: dict[str, type[Policy]] = {  # type: ignore[dict-item]
    "random": RandomPolicy,
    "round-robin": RoundRobinPolicy,
    "power-of-d": PowerOfDPolicy,
    "least-outstanding": LeastOutstandingPolicy,
    "peak-ewma": PeakEwmaPolicy,
    "jiq-random": JiqPolicy,
    "jiq-sq": JiqPolicy,
    "jiq-amnesia": JiqAmnesiaPolicy,
    "jiq-sed": JiqSedPolicy,
}
PULL = "pull"
POLICY_NAMES = (*POLICIES, PULL)
assert tuple(POLICIES) == c.DISPATCH_POLICIES, "fleet.constants.DISPATCH_POLICIES is out of date"
__all__ = ["POLICIES", "POLICY_NAMES", "PULL", "Choice", "Policy", "announce_to", "make_policy"]


def make_policy(name: str, d: int = 2) -> Policy:
    """Build the policy called ``name`` (one of ``POLICIES``); ``pull`` is not a dispatcher policy.

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    if name == "jiq-sq":
        return JiqPolicy(name="jiq-sq", announce="sq", d=d)
    cls = POLICIES.get(name)
    if cls is None:
        known = ", ".join(POLICY_NAMES)
        raise ValueError(
            f"unknown policy {name!r}; known: {known}" + (" (pull has no dispatcher)" if name == PULL else "")
        )
    return cls(d=d)  # type: ignore[call-arg]
