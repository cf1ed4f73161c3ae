"""Closed-form mean response times the simulator is checked against (mean service time 1, Poisson arrivals).

``load`` is the arrival rate per server over the service rate (lambda < 1). The large-system results hold as
n -> infinity; Erlang C and the M/G/1 results are exact at any size.

=====================  =========================================================================================
random                 every server is an M/G/1 queue (Poisson splitting); Pollaczek-Khinchine:
                       T = 1 + lambda E[S^2] / (2 (1 - lambda)); exponential: 1 / (1 - lambda), deterministic (M/D/1):
                       1 + lambda / (2 (1 - lambda)), lognormal with mean 1: E[S^2] = exp(sigma^2)
power-of-d (SQ(d))     Mitzenmacher (1996): T = sum_{i>=1} lambda^((d^i - d) / (d - 1)); exponential service, and only
                       with one dispatcher (with m > 1 each dispatcher sees only its own outstanding counts)
jiq-random             Lu et al. (2011), r = n / m servers per idle queue: the servers see random arrivals at the
                       reduced rate s = lambda / (1 + r (1 - lambda)) and T = 1 / (1 - s); exponential service.
                       It ignores that an idle server in an idle queue can be picked at random: exact as r -> inf.
                       ``jiq_random_retract_mean`` is the exact large-system limit with Fleet's retraction
jiq-sq                 the same reduction with the idle queues as an SQ(d) system fed by idle tokens: the share
                       rho of non-empty idle queues solves sum_{i>=1} rho^((d^i - 1) / (d - 1)) = r (1 - lambda),
                       s = lambda (1 - rho) (d = 1 gives the jiq-random formula)
pull                   one central queue, n servers: M/M/n, T = 1 + C(n, n lambda) / (n (1 - lambda)) with Erlang C
=====================  =========================================================================================
"""

from __future__ import annotations

import math

from fleet.dispatcher.policies import PULL

MAX_TERMS = 64
MAX_CHAIN_STATES = 200_000


def mg1_mean(load: float, second_moment: float) -> float:
    """M/G/1 (Pollaczek-Khinchine) mean response time for service mean 1 and E[S^2] = ``second_moment``."""
    return 1.0 + load * second_moment / (2.0 * (1.0 - load))


def mm1_mean(load: float) -> float:
    """M/M/1: 1 / (1 - load)."""
    return 1.0 / (1.0 - load)


def md1_mean(load: float) -> float:
    """M/D/1: 1 + load / (2 (1 - load))."""
    return mg1_mean(load, 1.0)


def _supermarket_tail_sum(load: float, d: int, offset: int) -> float:
    """sum_{i>=1} load^((d^i - offset) / (d - 1)), the exponents growing doubly exponentially (d >= 2)."""
    total = 0.0
    for i in range(1, MAX_TERMS):
        term = load ** ((d**i - offset) / (d - 1))
        total += term
        if term < 1e-15:
            break
    return total


def sqd_mean(load: float, d: int) -> float:
    """Supermarket model (join the shortest of d queues), n -> infinity (Mitzenmacher 1996)."""
    if d <= 1:
        return mm1_mean(load)
    return _supermarket_tail_sum(load, d, d)


def jiq_random_mean(load: float, ratio: float) -> float:
    """JIQ-Random (Lu et al. 2011) with ``ratio`` = r = servers per dispatcher, n -> infinity."""
    reduced = load / (1.0 + ratio * (1.0 - load))
    return 1.0 / (1.0 - reduced)


def _idle_queue_empty_share(empty: float, load: float, ratio: float) -> float:
    """Share of empty idle queues implied by a guess ``empty`` of it, for JIQ-Random with retraction.

    An idle queue is a birth-death chain: tokens arrive at rate ``ratio * (rate a server turns idle)``, the queue's
    own jobs (rate ``load * ratio``) use one when there is one, and each of its k tokens is retracted at the rate
    ``s = load * empty`` at which random assignments reach a server. The birth rate never exceeds the job rate, so
    the chain's weights only shrink and the sum below cannot overflow.
    """
    reduced = load * empty
    births = ratio * load * (1.0 - load * empty)
    weight, total, k = 1.0, 1.0, 0
    while k < MAX_CHAIN_STATES:
        k += 1
        weight *= births / (load * ratio + k * reduced)
        total += weight
        if weight < 1e-16 * total:
            break
    return 1.0 / total


def jiq_random_retract_mean(load: float, ratio: float) -> float:
    """JIQ-Random as Fleet runs it (a worker retracts its token when random work reaches it), n -> infinity.

    Lu et al.'s formula treats an idle queue as an M/M/1 queue of tokens served only by its dispatcher's jobs;
    with retraction tokens also leave when their server is picked at random, which keeps idle queues shorter and
    more often non-empty than that. This solves the mean-field fixed point (the share of empty idle queues) by
    bisection; each server then sees random arrivals at ``s = load * empty`` when busy and T = 1 / (1 - s).
    """
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if _idle_queue_empty_share(mid, load, ratio) > mid:
            lo = mid
        else:
            hi = mid
    return 1.0 / (1.0 - load * (lo + hi) / 2)


def jiq_sq_mean(load: float, ratio: float, d: int) -> float:
    """JIQ-SQ(d) (Lu et al. 2011): idle tokens join the shortest of d idle queues, n -> infinity."""
    if d <= 1:
        return jiq_random_mean(load, ratio)
    target = ratio * (1.0 - load)  # mean number of idle tokens per idle queue
    lo, hi = 0.0, 1.0
    for _ in range(100):  # the tail sum grows with rho from 0 to infinity: bisect
        mid = (lo + hi) / 2
        if _supermarket_tail_sum(mid, d, 1) < target:
            lo = mid
        else:
            hi = mid
    return 1.0 / (1.0 - load * (1.0 - lo))


def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits in M/M/n with ``offered`` = arrival rate / service rate (< servers)."""
    blocking = 1.0  # Erlang B by its stable recursion
    for k in range(1, servers + 1):
        blocking = offered * blocking / (k + offered * blocking)
    utilisation = offered / servers
    return blocking / (1.0 - utilisation * (1.0 - blocking))


def mmn_mean(load: float, servers: int) -> float:
    """M/M/n with per-server load ``load``: 1 + C(n, n load) / (n (1 - load))."""
    return 1.0 + erlang_c(servers, servers * load) / (servers * (1.0 - load))


def service_second_moment(service: str, sigma: float) -> float:
    """E[S^2] of the simulator's job sizes (mean 1)."""
    return {"exponential": 2.0, "deterministic": 1.0, "lognormal": math.exp(sigma**2)}[service]


def analytic_mean(
    policy: str,
    load: float,
    *,
    servers: int,
    dispatchers: int,
    service: str = "exponential",
    sigma: float = 1.0,
    d: int = 2,
    homogeneous: bool = True,
) -> float | None:
    """The closed-form mean for this simulated point, or ``None`` where no formula applies (see the table above)."""
    if not homogeneous:
        return None
    if policy == "random":
        return mg1_mean(load, service_second_moment(service, sigma))
    if service != "exponential":
        return None
    if policy == "power-of-d" and dispatchers == 1:
        return sqd_mean(load, d)
    if policy == "jiq-random":
        return jiq_random_mean(load, servers / dispatchers)
    if policy == "jiq-sq":
        return jiq_sq_mean(load, servers / dispatchers, d)
    if policy == PULL:
        return mmn_mean(load, servers)
    return None
