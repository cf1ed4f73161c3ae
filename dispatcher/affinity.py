"""Affinity routing: a request goes to a worker that has its model version loaded and warm; a cold worker (which
loads the version first, seconds for a real model) gets it only when no warm worker can take it within its wait
budget. Pure, like the policies: the live dispatcher and the simulator (``fleet.dispatcher.sim_affinity``) drive it.

**Warm.** A multi-model worker names the versions of the model it has loaded in every heartbeat
(``Heartbeat.loaded``); ``LoadedVersions.report`` keeps them. A request for version ``v`` is warm on a worker whose
list holds ``v``. A request without a version (the worker's default version, which the dispatcher cannot know per
worker) is warm on a worker with any version of the model loaded. A worker whose list is empty is warm for nothing:
a worker that does not report (one model, loaded at start) makes every request "cold everywhere", and then the
dispatcher's policy decides exactly as it does without affinity.

**Loading.** A cold assignment marks the worker as loading the version (``on_assign``); it counts as warm until a
heartbeat lists the version, or for ``load_grace_s`` when heartbeats keep not listing it (the load failed or the
version was evicted). Without the mark every request arriving during one load would start another load elsewhere.

**The choice** (``choose``), for a request for ``version`` with ``budget_s`` to wait:

1. no live worker is warm: the policy's choice (a cold load is unavoidable; ``cold`` says so unless it happens to
   pick a warm one);
2. a warm worker holds an idle token: that token (route ``idle``);
3. the warm worker expected to start the job soonest, when that is within ``budget_s`` (route ``warm``). Its wait is
   estimated as the policies' JIQ-SED estimate does: ``floor_s x (outstanding + 1)``, its service-time estimate
   times the jobs this dispatcher gave it plus one presumed running (a worker without a token is busy). A worker
   never measured waits 0;
4. otherwise an idle worker (the first idle token), which loads the version at once: a cold load;
5. with no idle worker at all, still the warm worker of step 3: a cold worker is busy too, so it would start the
   job later still (its queue, then the load), and its load would evict a version others are using.

**The budget** (``wait_budget_s``) is the ``affinity_wait_s`` setting, cut to the time left before the job's
deadline: a job waits for a warm worker at most that long, and never past its deadline (a cold worker is then its
only chance to run at all). 0 still prefers an idle warm worker; it only never queues behind a busy one.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from fleet.dispatcher.policies import Choice, Policy
from fleet.dispatcher.state import Bag, DispatcherState, WorkerView

W = TypeVar("W", bound=Hashable)

SEEN_MAX = 64  # warm workers looked at per choice: all of them up to this, a random sample beyond
DEFAULT_LOAD_GRACE_S = 10.0


def expected_wait_s(view: WorkerView) -> float:
    """When a busy worker is expected to start one more job: its service time x (outstanding + 1)."""
    return view.floor_s * (view.outstanding + 1)


def wait_budget_s(affinity_wait_s: float, deadline: float | None, now_unix: float) -> float:
    """How long a job may wait for a warm worker: ``affinity_wait_s``, and never past its ``deadline``."""
    if deadline is None:
        return max(0.0, affinity_wait_s)
    return max(0.0, min(affinity_wait_s, deadline - now_unix))


@dataclass(slots=True)
class LoadedVersions(Generic[W]):
    """Which workers have which versions of one model loaded, from their heartbeats and our cold assignments.

    Args:
        load_grace_s: how long a cold assignment counts as "loading, so warm" while heartbeats do not list it.
    """

    load_grace_s: float = DEFAULT_LOAD_GRACE_S
    _reported: dict[W, frozenset[str]] = field(default_factory=dict)
    _loading: dict[W, dict[str, float]] = field(default_factory=dict)  # worker -> version -> marked at
    _by_version: dict[str, Bag[W]] = field(default_factory=dict)
    _any: Bag[W] = field(default_factory=Bag)  # workers with some version loaded (warm for the default version)

    def report(self, worker: W, versions: Iterable[str], now: float) -> None:
        """A heartbeat's ``loaded`` list: the worker's warm versions now (loading marks past their grace lapse)."""
        reported = frozenset(versions)
        loading = {
            v: at
            for v, at in self._loading.get(worker, {}).items()
            if v not in reported and now - at < self.load_grace_s
        }
        self._reported[worker] = reported
        if loading:
            self._loading[worker] = loading
        else:
            self._loading.pop(worker, None)
        self._index(worker, reported | loading.keys())

    def on_assign(self, worker: W, version: str | None, now: float) -> None:
        """A job for ``version`` went to ``worker``: when it is not warm there, the worker is loading it now."""
        if version is None or self.is_warm(worker, version):
            return
        self._loading.setdefault(worker, {})[version] = now
        self._index(worker, self.versions(worker) | {version})

    def forget(self, worker: W) -> None:
        """The worker is gone."""
        self._reported.pop(worker, None)
        self._loading.pop(worker, None)
        self._index(worker, frozenset())

    def versions(self, worker: W) -> frozenset[str]:
        """What ``worker`` has loaded or is loading."""
        return self._reported.get(worker, frozenset()) | self._loading.get(worker, {}).keys()

    def warm(self, version: str | None) -> Bag[W]:
        """The workers warm for ``version`` (``None``: the default version, i.e. any version loaded)."""
        if version is None:
            return self._any
        return self._by_version.get(version) or Bag()

    def is_warm(self, worker: W, version: str | None) -> bool:
        return worker in self.warm(version)

    def _index(self, worker: W, versions: frozenset[str] | set[str]) -> None:
        for version, bag in list(self._by_version.items()):
            if version not in versions:
                bag.discard(worker)
                if not len(bag):
                    del self._by_version[version]
        for version in versions:
            self._by_version.setdefault(version, Bag()).add(worker)
        if versions:
            self._any.add(worker)
        else:
            self._any.discard(worker)


def choose(
    policy: Policy,
    state: DispatcherState[W],
    loaded: LoadedVersions[W],
    version: str | None,
    budget_s: float,
    now: float,
    rng: random.Random,
) -> Choice[W] | None:
    """Where a request for ``version`` goes (see the module docstring); ``None`` only when no worker is live.

    Like the policies it uses a token it picks (``state``); the caller records the assignment
    (``state.on_assign`` and ``loaded.on_assign``).
    """
    best: WorkerView[W] | None = None
    best_wait = float("inf")
    for worker in _seen(loaded.warm(version), rng):
        if not state.is_live(worker):
            continue
        seq = state.token_of(worker)
        if seq is not None and state.take_token(worker, seq):
            return Choice(worker, "idle", seq)
        view = state.views[worker]
        wait = expected_wait_s(view)
        if wait < best_wait:
            best, best_wait = view, wait
    if best is not None and best_wait <= budget_s:
        return Choice(best.worker, "warm")
    if best is not None:
        token = state.pop_token()  # an idle worker: it starts loading at once
        if token is not None:
            return Choice(token[0], "idle", token[1], cold=not loaded.is_warm(token[0], version))
        return Choice(best.worker, "warm")  # every worker is busy: a cold one would start it later still
    choice = policy.choose(state, now, rng)
    if choice is None or loaded.is_warm(choice.worker, version):
        return choice
    return Choice(choice.worker, choice.route, choice.token, cold=True)


def _seen(warm: Bag[W], rng: random.Random) -> list[W]:
    """Every warm worker, in a random order (ties go to a random one); a random ``SEEN_MAX`` of a larger set."""
    n = len(warm)
    return [warm.at(i) for i in rng.sample(range(n), min(n, SEEN_MAX))]
