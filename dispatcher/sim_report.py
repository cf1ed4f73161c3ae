"""``fleet sim``'s front half: worker speeds from a short spec, the grid of (policy, load) points, result rows.

A row is a plain dict (what ``--json`` prints): ``policy``, ``load``, ``mean``, ``p50``, ``p99``, ``p999``,
``p99_p50``, the shares of assignments made through idle tokens, the amnesia list and the random fallback, the
number of ``jobs`` counted after warm-up, the ``backlog`` of jobs in the system when the last one arrived,
``unstable`` (that backlog grew over the second half: some worker was overloaded, or the run was too short to warm
up), ``wall_s``, and with ``analytic`` the closed-form mean where one exists. All times are in mean service times.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from fractions import Fraction
from typing import Any

from fleet.dispatcher.analytic import analytic_mean, jiq_random_retract_mean
from fleet.dispatcher.sim_engine import Progress, SimConfig, SimResult, simulate

Row = dict[str, Any]


def parse_speeds(spec: str, servers: int | None = None) -> list[float]:
    """Worker speeds from ``SPEEDxCOUNT,...`` (``1x6,0.333x2``; ``1/3x2`` works too; a bare ``SPEED`` is one worker).

    With ``servers`` given and different from the total count, the counts are scaled to ``servers`` in proportion
    (``1x3,0.5x1`` with 1000 servers is 750 at speed 1 and 250 at speed 0.5).

    Raises:
        ValueError: a malformed group, a speed that is not positive, or a count below 1.
    """
    groups: list[tuple[float, int]] = []
    for part in (p.strip() for p in spec.split(",")):
        speed_text, _, count_text = part.partition("x")
        try:
            speed = float(Fraction(speed_text.strip()))
            count = int(count_text) if count_text else 1
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"bad speed group {part!r}: write SPEEDxCOUNT, for example 1x6 or 0.333x2") from None
        if speed <= 0 or count < 1:
            raise ValueError(f"bad speed group {part!r}: the speed must be > 0 and the count >= 1")
        groups.append((speed, count))
    total = sum(count for _, count in groups)
    if servers is not None and servers != total:
        if servers < len(groups):
            raise ValueError(f"{len(groups)} speed groups do not fit in {servers} servers")
        groups = list(zip((s for s, _ in groups), _scale_counts([c for _, c in groups], servers), strict=True))
    return [speed for speed, count in groups for _ in range(count)]


def _scale_counts(counts: list[int], servers: int) -> list[int]:
    """Counts in the same proportions summing to ``servers`` (largest remainder, at least 1 each)."""
    total = sum(counts)
    exact = [c * servers / total for c in counts]
    scaled = [max(1, math.floor(x)) for x in exact]
    by_remainder = sorted(range(len(counts)), key=lambda i: exact[i] - scaled[i], reverse=True)
    i = 0
    while sum(scaled) != servers:
        j = by_remainder[i % len(counts)]
        step = 1 if sum(scaled) < servers else -1
        if scaled[j] + step >= 1:
            scaled[j] += step
        i += 1
    return scaled


def grid(base: SimConfig, policies: Sequence[str], loads: Sequence[float]) -> list[SimConfig]:
    """One config per (policy, load), policies outermost; every point uses the same seed (common random numbers)."""
    return [replace(base, policy=p, load=load) for p in policies for load in loads]


def result_row(result: SimResult, *, with_analytic: bool = False) -> Row:
    """The printable statistics of one point."""
    c = result.config
    p50, p99, p999 = (result.quantile(q) for q in (0.5, 0.99, 0.999))
    row: Row = {
        "policy": c.policy,
        "load": c.load,
        "servers": c.servers,
        "dispatchers": c.dispatchers,
        "service": c.service,
        "mean": result.mean,
        "p50": p50,
        "p99": p99,
        "p999": p999,
        "p99_p50": p99 / p50 if p50 > 0 else None,
        "idle_share": result.route_share("idle"),
        "amnesia_share": result.route_share("amnesia"),
        "fallback_share": result.route_share("fallback"),
        "jobs": result.jobs,
        "backlog": result.backlog[1],
        "unstable": result.unstable,
        "wall_s": result.wall_s,
    }
    if with_analytic:
        row.update(analytic_fields(c))
    return row


def analytic_fields(c: SimConfig) -> Row:
    """``analytic`` (the closed-form mean or ``None``) and, for JIQ-Random, ``analytic_retract`` (see ``analytic``)."""
    homogeneous = c.speeds is None or len(set(c.speeds)) == 1
    mean = analytic_mean(
        c.policy,
        c.load,
        servers=c.servers,
        dispatchers=c.dispatchers,
        service=c.service,
        sigma=c.sigma,
        d=c.d,
        homogeneous=homogeneous,
    )
    fields: Row = {"analytic": mean}
    if c.policy == "jiq-random" and mean is not None and c.retract:
        fields["analytic_retract"] = jiq_random_retract_mean(c.load, c.servers / c.dispatchers)
    return fields


def run_grid(
    configs: Iterable[SimConfig],
    *,
    with_analytic: bool = False,
    on_point: Callable[[SimConfig], Progress | None] | None = None,
) -> list[Row]:
    """Simulate every config in turn; ``on_point(config)`` may return a progress callback for that point."""
    rows = []
    for config in configs:
        progress = on_point(config) if on_point is not None else None
        rows.append(result_row(simulate(config, progress), with_analytic=with_analytic))
    return rows
