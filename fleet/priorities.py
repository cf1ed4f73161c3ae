"""The weighting of priority levels: which level a consumer serves first in each fetch round. Pure functions.

The rule. The levels are ``high``, ``normal`` and ``low`` with weights ``(w_high, w_normal, w_low)`` (default
``6, 3, 1``; ``FLEET_PRIORITY_WEIGHTS``). Fetch rounds are numbered; in every cycle of ``sum(weights)`` rounds,
each level *leads* exactly its weight's count of rounds, spread evenly (smooth weighted round-robin, as nginx
balances upstreams). A round serves its lead level first, then the others in strict order (high, normal, low); the
first level with a message waiting is the one served. So:

* with all levels backlogged, high gets ``w_high / sum`` of the rounds, normal ``w_normal / sum``, low
  ``w_low / sum`` (default 60 / 30 / 10 %): **low never starves**; with the defaults a waiting low message is
  served within 10 rounds, however much high and normal work there is;
* a level with nothing waiting gives its rounds away (strict order), so no capacity is idle while work waits,
  and a lone high message jumps every lower backlog (at most ``w_low + w_normal`` rounds out of ``sum`` lead with a
  lower level, and none of them in a row longer than the spread allows).
"""

from __future__ import annotations

from functools import lru_cache

from fleet.constants import DEFAULT_PRIORITY, DEFAULT_PRIORITY_WEIGHTS, PRIORITIES, REQ_PREFIX

Weights = tuple[int, int, int]


def check_weights(weights: tuple[int, ...]) -> Weights:
    """``weights`` as (high, normal, low) when there are three integers of at least 1; ``ValueError`` otherwise."""
    if len(weights) != len(PRIORITIES) or any(not isinstance(w, int) or isinstance(w, bool) for w in weights):
        raise ValueError(f"priority weights must be three integers (high, normal, low), got {weights!r}")
    if min(weights) < 1:
        raise ValueError(f"every priority weight must be at least 1 (0 would starve that level), got {weights!r}")
    return weights[0], weights[1], weights[2]


@lru_cache(maxsize=64)
def serve_cycle(weights: Weights = DEFAULT_PRIORITY_WEIGHTS) -> tuple[str, ...]:
    """The lead level of each round of one cycle (``sum(weights)`` rounds), by smooth weighted round-robin.

    Each round, every level's credit grows by its weight; the level with the most credit (the higher one on a tie)
    leads and pays back the total. ``(6, 3, 1)`` gives ``high normal high high normal high low high normal high``.
    """
    check_weights(weights)
    total = sum(weights)
    credit = [0] * len(weights)
    cycle: list[str] = []
    for _ in range(total):
        credit = [have + weight for have, weight in zip(credit, weights, strict=True)]
        lead = max(range(len(credit)), key=lambda i: (credit[i], -i))
        credit[lead] -= total
        cycle.append(PRIORITIES[lead])
    return tuple(cycle)


def serve_order(round_no: int, weights: Weights = DEFAULT_PRIORITY_WEIGHTS) -> tuple[str, ...]:
    """The order in which round ``round_no`` looks at the levels: its lead level, then the rest highest first."""
    cycle = serve_cycle(weights)
    lead = cycle[round_no % len(cycle)]
    return (lead, *(level for level in PRIORITIES if level != lead))


def priority_of_subject(subject: str, model: str) -> str:
    """The priority level of a request subject of ``model`` (``fleet.req.<model>[.<level>]``); normal otherwise."""
    base = f"{REQ_PREFIX}.{model}"
    level = subject.removeprefix(base + ".") if subject.startswith(base + ".") else DEFAULT_PRIORITY
    return level if level in PRIORITIES else DEFAULT_PRIORITY


def rank(priority: str) -> int:
    """0 for high, 1 for normal, 2 for low: a sort key, highest first."""
    return PRIORITIES.index(priority) if priority in PRIORITIES else PRIORITIES.index(DEFAULT_PRIORITY)
