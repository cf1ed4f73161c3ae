"""The discrete-event core of ``fleet sim``: n workers, m dispatchers, Poisson arrivals, one event heap.

Every dispatcher is a real ``DispatcherState`` with its own policy instance from ``make_policy``: the simulator
drives exactly the code the live dispatcher runs. Time is in mean service times (a job of mean size 1 takes 1 on a
worker of speed 1), so ``load`` is the arrival rate divided by the total capacity (the sum of worker speeds).

Model:

* arrivals are Poisson at rate ``load * sum(speeds)``; each goes to a uniformly random dispatcher, which calls
  ``policy.choose`` then ``state.on_assign``; the job's size (mean 1) is drawn at arrival, its service time on a
  worker is size / speed, and a worker serves its own FIFO queue one job at a time;
* a completion calls ``on_complete(worker, response_time, now)`` on the dispatcher that assigned it;
* for JIQ policies (``announce != "none"``) a worker that becomes idle (at time 0, and when a completion empties its
  queue) announces itself with a fresh token to the dispatcher that ``announce_to`` picks; a worker that receives a
  job which did not use its outstanding token retracts it, as the live worker does (``retract=False`` leaves stale
  tokens in place, for comparison);
* ``pull`` is one central FIFO queue: the longest-idle worker takes the head job.

The hot loops bind everything to locals and allocate one small tuple per job; they are longer than house style
likes because a function call per event costs a measurable share of the run time.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from fleet.dispatcher.policies import PULL, Policy, announce_to, make_policy
from fleet.dispatcher.state import DispatcherState

ServiceDist = Literal["exponential", "deterministic", "lognormal"]
SERVICE_DISTS: tuple[ServiceDist, ...] = ("exponential", "deterministic", "lognormal")
ROUTES = ("idle", "amnesia", "fallback", "policy")
CHUNK = 1 << 16  # random numbers are drawn from numpy this many at a time
PROGRESS_EVERY = 1 << 14  # arrivals between progress callbacks
# Work that piles up over the second half of the run at 1% or more of the arrival rate means no steady state.
UNSTABLE_GROWTH_SHARE = 0.005  # of all arrivals, i.e. 1% of the second half's
UNSTABLE_GROWTH_JOBS = 50

Progress = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated point. Times are in mean service times.

    Args:
        policy: a name from ``fleet.dispatcher.policies.POLICY_NAMES`` (``pull`` is the central-queue baseline).
        load: arrival rate over total capacity, in (0, 1).
        servers: n, the number of workers.
        dispatchers: m, the number of dispatchers (ignored by ``pull``).
        jobs: arrivals simulated; the first ``warmup_fraction`` of them are left out of the statistics.
        service: job size distribution, mean 1; ``sigma`` is the lognormal's shape parameter.
        d: the policies' sample size (power-of-d, peak-ewma, JIQ-SQ(d) announcements, amnesia sampling).
        speeds: one speed per worker (``None``: all 1).
        retract: JIQ workers retract their idle token when they get work elsewhere (the live behaviour).
        amnesia_window: how long a worker stays on a dispatcher's amnesia list after a completion.
    """

    policy: str
    load: float
    servers: int = 100
    dispatchers: int = 1
    jobs: int = 100_000
    service: ServiceDist = "exponential"
    sigma: float = 1.0
    d: int = 2
    speeds: tuple[float, ...] | None = None
    seed: int = 1
    warmup_fraction: float = 0.1
    retract: bool = True
    amnesia_window: float = 10.0

    def worker_speeds(self) -> list[float]:
        return list(self.speeds) if self.speeds is not None else [1.0] * self.servers


@dataclass(slots=True)
class SimResult:
    """Response-time statistics of one point (in mean service times) and how the dispatchers routed."""

    config: SimConfig
    samples: np.ndarray  # response times of the jobs after warm-up
    routes: dict[str, int] = field(default_factory=dict)
    backlog: tuple[int, int] = (0, 0)  # jobs in the system halfway through the arrivals and after the last one
    wall_s: float = 0.0

    @property
    def unstable(self) -> bool:
        """The backlog kept growing: some worker got more work than it can do (a slow one, picked at random), or
        the run is too short to warm up; the statistics then describe this run's length, not a steady state."""
        half, end = self.backlog
        return end - half > max(UNSTABLE_GROWTH_JOBS, UNSTABLE_GROWTH_SHARE * self.config.jobs)

    @property
    def jobs(self) -> int:
        return int(self.samples.size)

    @property
    def mean(self) -> float:
        return float(self.samples.mean())

    def quantile(self, q: float) -> float:
        return float(np.quantile(self.samples, q))

    def route_share(self, route: str) -> float:
        total = sum(self.routes.values())
        return self.routes.get(route, 0) / total if total else 0.0


def _stream(draw: Callable[[int], np.ndarray]) -> Iterator[Any]:
    """Random numbers one at a time, drawn lazily in chunks (numpy is fast per chunk, slow per call)."""
    while True:
        yield from draw(CHUNK).tolist()


def size_stream(service: ServiceDist, sigma: float, gen: np.random.Generator) -> Iterator[float]:
    """Job sizes with mean 1."""
    if service == "exponential":
        return _stream(lambda k: gen.exponential(1.0, k))
    if service == "deterministic":
        return iter(lambda: 1.0, None)  # never ends
    if service == "lognormal":
        mu = -(sigma**2) / 2  # E[exp(N(mu, sigma^2))] = exp(mu + sigma^2 / 2) = 1
        return _stream(lambda k: gen.lognormal(mu, sigma, k))
    raise ValueError(f"unknown service distribution {service!r}; known: {', '.join(SERVICE_DISTS)}")


def simulate(config: SimConfig, progress: Progress | None = None) -> SimResult:
    """Run one point. ``progress(arrivals_so_far)`` is called now and then for progress bars.

    Raises:
        ValueError: an unknown policy or service distribution, or speeds that do not match ``servers``.
    """
    speeds = config.worker_speeds()
    if len(speeds) != config.servers or min(speeds) <= 0:
        raise ValueError(f"need {config.servers} positive speeds, got {len(speeds)}")
    # One generator per stream: every policy at a point sees the same arrival times and job sizes.
    gap_gen, size_gen, pick_gen = (np.random.default_rng(s) for s in np.random.SeedSequence(config.seed).spawn(3))
    rate = config.load * sum(speeds)
    gaps = _stream(lambda k: gap_gen.exponential(1.0 / rate, k))
    sizes = size_stream(config.service, config.sigma, size_gen)
    started = time.perf_counter()
    if config.policy == PULL:
        samples, routes, backlog = _run_pull(config, speeds, gaps, sizes, progress)
    else:
        m = config.dispatchers
        picks = _stream(lambda k: pick_gen.integers(0, m, k)) if m > 1 else iter(lambda: 0, None)
        samples, routes, backlog = _run_dispatch(config, speeds, gaps, sizes, picks, progress)
    if progress is not None:
        progress(config.jobs)
    return SimResult(config, np.asarray(samples), routes, backlog, time.perf_counter() - started)


def _build(config: SimConfig) -> tuple[list[DispatcherState[int]], list[Policy]]:
    states: list[DispatcherState[int]] = []
    policies = [make_policy(config.policy, config.d) for _ in range(config.dispatchers)]
    for _ in range(config.dispatchers):
        state: DispatcherState[int] = DispatcherState(amnesia_window_s=config.amnesia_window)
        for w in range(config.servers):
            state.add_worker(w)
        states.append(state)
    return states, policies


def _run_dispatch(
    config: SimConfig,
    speeds: list[float],
    gaps: Iterator[float],
    sizes: Iterator[float],
    picks: Iterator[int],
    progress: Progress | None,
) -> tuple[list[float], dict[str, int], tuple[int, int]]:
    states, policies = _build(config)
    rng = random.Random(config.seed)
    rule, d, retract = policies[0].announce, config.d, config.retract
    announcing = rule != "none"
    lengths = [0] * config.dispatchers  # idle-queue lengths for announce_to, kept current after each change
    n = config.servers
    queues: list[deque[tuple[float, float, int]]] = [deque() for _ in range(n)]
    token_at = [-1] * n  # the dispatcher holding the worker's outstanding token, -1: none
    token_seq = [0] * n
    seq = 0
    heap: list[tuple[float, int]] = []
    push, pop = heapq.heappush, heapq.heappop
    samples: list[float] = []
    record = samples.append
    routes = dict.fromkeys(ROUTES, 0)
    jobs = config.jobs
    warm_index = int(jobs * config.warmup_fraction)
    half_index, half_backlog = jobs // 2, 0
    warm_t = float("inf")  # arrival time of the first counted job, known once it arrives
    t = 0.0

    def announce(w: int) -> None:
        """The idle worker ``w`` sends a fresh token to the dispatcher the policy's rule picks."""
        nonlocal seq
        seq += 1
        k = announce_to(lengths, rule, d, rng)
        states[k].add_token(w, seq)
        lengths[k] = states[k].idle_length
        token_at[w], token_seq[w] = k, seq

    def complete(now: float, w: int) -> None:
        """Worker ``w`` finishes its head job at ``now``: record it, start the next or announce itself idle."""
        q = queues[w]
        arrived, _, k = q.popleft()
        response = now - arrived
        if arrived >= warm_t:
            record(response)
        states[k].on_complete(w, response, now)
        if q:
            push(heap, (now + q[0][1] / speeds[w], w))
        elif announcing:
            announce(w)

    if announcing:
        for w in range(n):
            announce(w)
    for j in range(jobs):
        t += next(gaps)
        while heap and heap[0][0] <= t:
            complete(*pop(heap))
        if j == warm_index:
            warm_t = t
        elif j == half_index:
            half_backlog = sum(map(len, queues))
        if progress is not None and not j % PROGRESS_EVERY:
            progress(j)
        k = next(picks)
        state = states[k]
        choice = policies[k].choose(state, t, rng)
        if choice is None:
            raise RuntimeError("no live worker")  # cannot happen: every worker is live throughout
        w = choice.worker
        state.on_assign(w, t)
        if choice.token is not None:
            lengths[k] = state.idle_length
        routes[choice.route] += 1
        held = token_at[w]
        if held >= 0:
            if choice.token != token_seq[w] and retract:
                states[held].retract(w, token_seq[w])
                lengths[held] = states[held].idle_length
            token_at[w] = -1
        q = queues[w]
        size = next(sizes)
        q.append((t, size, k))
        if len(q) == 1:
            push(heap, (t + size / speeds[w], w))
    backlog = (half_backlog, sum(map(len, queues)))
    announcing = False  # the run is over: idle workers need not announce while the backlog drains
    while heap:
        complete(*pop(heap))
    return samples, routes, backlog


def _run_pull(
    config: SimConfig, speeds: list[float], gaps: Iterator[float], sizes: Iterator[float], progress: Progress | None
) -> tuple[list[float], dict[str, int], tuple[int, int]]:
    central: deque[tuple[float, float]] = deque()
    free = deque(range(config.servers))  # idle workers, longest idle first
    serving = [0.0] * config.servers  # arrival time of the job each busy worker serves
    heap: list[tuple[float, int]] = []
    push, pop = heapq.heappush, heapq.heappop
    samples: list[float] = []
    record = samples.append
    jobs = config.jobs
    warm_index = int(jobs * config.warmup_fraction)
    half_index, half_backlog = jobs // 2, 0
    warm_t = float("inf")
    t = 0.0
    for j in range(jobs):
        t += next(gaps)
        while heap and heap[0][0] <= t:
            now, w = pop(heap)
            if serving[w] >= warm_t:
                record(now - serving[w])
            if central:
                serving[w], size = central.popleft()
                push(heap, (now + size / speeds[w], w))
            else:
                free.append(w)
        if j == warm_index:
            warm_t = t
        elif j == half_index:
            half_backlog = len(central) + len(heap)
        if progress is not None and not j % PROGRESS_EVERY:
            progress(j)
        if free:
            w = free.popleft()
            serving[w] = t
            push(heap, (t + next(sizes) / speeds[w], w))
        else:
            central.append((t, next(sizes)))
    backlog = (half_backlog, len(central) + len(heap))
    while heap:
        now, w = pop(heap)
        if serving[w] >= warm_t:
            record(now - serving[w])
        if central:
            serving[w], size = central.popleft()
            push(heap, (now + size / speeds[w], w))
    return samples, {"policy": jobs}, backlog
