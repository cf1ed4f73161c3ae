"""The usage report as a pure function: the store's counts filtered to a tenant, grouped and priced.

Cost is priced per device kind before grouping (a group without ``device`` may hold CPU and GPU time at different
prices): ``device_seconds / 3600 * price``, a kind without a price costing 0. ``cost_per_1k_requests`` is a group's
cost per 1,000 jobs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fleet.schemas.usage import GroupField, UsageRow
from fleet.store.usage import UsageCount, UsageKey


def cost_of(device_seconds: float, price_per_hour: float) -> float:
    return device_seconds / 3600.0 * price_per_hour


def per_1k(cost: float, jobs: int) -> float | None:
    return cost * 1000.0 / jobs if jobs else None


def grouped(
    counts: Mapping[UsageKey, UsageCount],
    group_by: Sequence[GroupField],
    prices: Mapping[str, float],
    tenant: str | None = None,
) -> tuple[list[UsageRow], UsageRow]:
    """Rows per distinct value of ``group_by`` (largest device-seconds first) and their total; only ``tenant``'s
    counts when it is given (None: every tenant's)."""
    sums: dict[tuple[str, ...], tuple[UsageCount, list[float]]] = {}
    for key, count in counts.items():
        if tenant is not None and key.tenant != tenant:
            continue
        group = tuple(getattr(key, field) for field in group_by)
        summed, cost = sums.setdefault(group, (UsageCount(), [0.0]))
        summed.add(count)
        cost[0] += cost_of(count.device_seconds, prices.get(key.device, 0.0))
    rows = [_row(dict(zip(group_by, group, strict=True)), s, cost[0]) for group, (s, cost) in sums.items()]
    rows.sort(key=lambda r: (-r.device_seconds, r.tenant or "", r.model or "", r.version or "", r.device or ""))
    total = UsageCount()
    for summed, _ in sums.values():
        total.add(summed)
    return rows, _row({}, total, sum(cost[0] for _, cost in sums.values()))


def _row(fields: dict[str, str], count: UsageCount, cost: float) -> UsageRow:
    return UsageRow(
        **fields,
        jobs=count.jobs,
        items=count.items,
        device_seconds=count.device_seconds,
        cost=cost,
        cost_per_1k_requests=per_1k(cost, count.jobs),
    )
