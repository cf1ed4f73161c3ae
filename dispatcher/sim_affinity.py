"""Simulated multi-model workers behind one dispatcher: how many cold loads affinity routing avoids.

``n`` workers each hold at most ``capacity`` versions (their memory budget) and evict the least recently used one
to load another; a job for a version a worker does not hold costs ``load_time`` extra (in mean service times) when
it starts there, and is counted as a cold load. Requests arrive as a Poisson stream whose versions follow a Zipf
law, the usual shape of many models' traffic. One dispatcher, with its real ``DispatcherState``, policy and
``LoadedVersions``, chooses with ``fleet.dispatcher.affinity.choose`` (``affinity=True``) or with the policy alone
(``affinity=False``); workers announce idle tokens to it and report what they hold at once (the live workers do
it in their next heartbeat, which the dispatcher's loading mark stands in for).

Like ``sim_engine``, times are in mean service times and every run with the same seed sees the same arrivals,
sizes and versions, so the two modes are compared on identical traffic.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from fleet.dispatcher import affinity
from fleet.dispatcher.policies import make_policy
from fleet.dispatcher.state import DispatcherState


@dataclass(frozen=True, slots=True)
class AffinitySimConfig:
    """One simulated point.

    Args:
        affinity: route with ``affinity.choose`` (else the policy alone).
        policy: a dispatcher policy name (``fleet.dispatcher.policies.POLICIES``).
        servers: workers; capacity: versions one worker holds at once; versions: distinct versions requested.
        zipf_s: the popularity exponent: version k is requested in proportion to 1 / k ** zipf_s.
        load: arrival rate over the workers' total capacity (cold loads come on top of it).
        load_time: a cold load's cost, in mean service times.
        wait_budget: how long a job may wait for a warm worker (``affinity_wait_s``), in mean service times.
    """

    affinity: bool = True
    policy: str = "jiq-amnesia"
    servers: int = 8
    capacity: int = 2
    versions: int = 8
    zipf_s: float = 1.1
    load: float = 0.5
    load_time: float = 5.0
    wait_budget: float = 2.0
    jobs: int = 20_000
    seed: int = 1
    warmup_fraction: float = 0.1


@dataclass(frozen=True, slots=True)
class AffinitySimResult:
    config: AffinitySimConfig
    samples: np.ndarray  # response times after warm-up
    cold_loads: int  # over every job, warm-up included
    warm_routes: int  # assignments affinity made to a busy warm worker

    @property
    def cold_per_1000(self) -> float:
        return 1000 * self.cold_loads / self.config.jobs

    def quantile(self, q: float) -> float:
        return float(np.quantile(self.samples, q))


def simulate_affinity(config: AffinitySimConfig) -> AffinitySimResult:
    """Run one point (see the module docstring)."""
    gap_gen, size_gen, version_gen = (np.random.default_rng(s) for s in np.random.SeedSequence(config.seed).spawn(3))
    n, jobs = config.servers, config.jobs
    gaps = gap_gen.exponential(1.0 / (config.load * n), jobs)
    sizes = size_gen.exponential(1.0, jobs)
    weights = 1.0 / np.arange(1, config.versions + 1) ** config.zipf_s
    versions = version_gen.choice(config.versions, size=jobs, p=weights / weights.sum())
    sim = _Sim(config)
    t = 0.0
    warm_index = int(jobs * config.warmup_fraction)
    for j in range(jobs):
        t += float(gaps[j])
        sim.advance(t)
        sim.arrive(t, float(sizes[j]), f"v{versions[j]}", counted=j >= warm_index)
    sim.advance(float("inf"))
    return AffinitySimResult(config, np.asarray(sim.samples), sim.cold_loads, sim.warm_routes)


class _Sim:
    def __init__(self, config: AffinitySimConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.policy = make_policy(config.policy)
        self.state: DispatcherState[int] = DispatcherState()
        self.loaded: affinity.LoadedVersions[int] = affinity.LoadedVersions(load_grace_s=config.load_time)
        self.queues: list[deque[tuple[float, float, str, bool]]] = [deque() for _ in range(config.servers)]
        self.caches: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(config.servers)]
        self.tokens = [-1] * config.servers  # each worker's outstanding token, -1: none
        self.seq = 0
        self.heap: list[tuple[float, int]] = []
        self.samples: list[float] = []
        self.cold_loads = 0
        self.warm_routes = 0
        for w in range(config.servers):
            self.state.add_worker(w)
            self._announce(w)

    def arrive(self, now: float, size: float, version: str, counted: bool) -> None:
        if self.config.affinity:
            choice = affinity.choose(
                self.policy, self.state, self.loaded, version, self.config.wait_budget, now, self.rng
            )
        else:
            choice = self.policy.choose(self.state, now, self.rng)
        assert choice is not None  # every worker is live throughout
        w = choice.worker
        self.state.on_assign(w, now)
        self.loaded.on_assign(w, version, now)
        self.warm_routes += choice.route == "warm"
        if self.tokens[w] >= 0 and choice.token != self.tokens[w]:
            self.state.retract(w, self.tokens[w])  # it took work elsewhere, as a live worker retracts
        self.tokens[w] = -1
        self.queues[w].append((now, size, version, counted))
        if len(self.queues[w]) == 1:
            self._start(w, now)

    def advance(self, until: float) -> None:
        while self.heap and self.heap[0][0] <= until:
            now, w = heapq.heappop(self.heap)
            arrived, _, _, counted = self.queues[w].popleft()
            if counted:
                self.samples.append(now - arrived)
            self.state.on_complete(w, now - arrived, now)
            if self.queues[w]:
                self._start(w, now)
            else:
                self._announce(w)

    def _start(self, w: int, now: float) -> None:
        _, size, version, _ = self.queues[w][0]
        cache = self.caches[w]
        extra = 0.0
        if version in cache:
            cache.move_to_end(version)
        else:
            self.cold_loads += 1
            extra = self.config.load_time
            cache[version] = None
            if len(cache) > self.config.capacity:
                cache.popitem(last=False)
            self.loaded.report(w, cache, now)
        heapq.heappush(self.heap, (now + extra + size, w))

    def _announce(self, w: int) -> None:
        self.seq += 1
        self.state.add_token(w, self.seq)
        self.tokens[w] = self.seq
