"""The per-tenant limits as the settings write them: ``FLEET_RATE_LIMIT``, ``FLEET_TENANT_MAX_QUEUED`` and
``FLEET_TENANT_LIMITS`` parsed into a ``LimitPolicy`` (a default ``TenantLimit`` and the tenants' overrides).

A leaf: ``fleet.settings`` validates with it and ``fleet.store.quotas`` enforces it, so neither reaches into the other
(the settings once imported the store's quota module inside a validator, hiding an import circle through the store
and ``fleet.links``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(s|sec|second|m|min|minute|h|hour)\s*(?:burst\s+(\d+))?\s*$")
PER_S = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60, "h": 3600, "hour": 3600}
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # as fleet.store.keys.check_tenant
LIMIT_FIELDS = ("rate", "burst", "max_queued")


@dataclass(frozen=True, slots=True)
class TenantLimit:
    """One tenant's limits: ``rate`` admits per second (None: no rate limit) with bursts of ``burst``, and at most
    ``max_queued`` jobs queued or running at once (0: no bound)."""

    rate: float | None = None
    burst: int = 1
    max_queued: int = 0

    @property
    def enabled(self) -> bool:
        return self.rate is not None or self.max_queued > 0

    @property
    def interval_us(self) -> int:
        """Microseconds between two admits at the steady rate (0: no rate limit)."""
        return 0 if self.rate is None else max(1, round(1_000_000 / self.rate))

    @property
    def window_s(self) -> int:
        """Seconds a whole burst takes to come back: the window of ``RateLimit-Policy``."""
        return 0 if self.rate is None else max(1, math.ceil(self.burst / self.rate))


@dataclass(frozen=True, slots=True)
class LimitPolicy:
    """The default limit and the tenants that have their own."""

    default: TenantLimit = field(default_factory=TenantLimit)
    tenants: Mapping[str, TenantLimit] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.default.enabled or any(limit.enabled for limit in self.tenants.values())

    @property
    def bounds_queued(self) -> bool:
        """Whether any tenant has a quota (a worker then releases its jobs as it settles them)."""
        return self.default.max_queued > 0 or any(limit.max_queued > 0 for limit in self.tenants.values())

    def for_tenant(self, tenant: str) -> TenantLimit:
        return self.tenants.get(tenant, self.default)


# -- parsing the settings -------------------------------------------------------------------------------------
def parse_rate(value: str) -> tuple[float, int]:
    """``'20/s burst 40'``, ``'20/s'`` (burst: one second's worth), ``'600/m burst 50'``, ``'3600/h'`` as
    (admits per second, burst). Raises ValueError saying what to write."""
    found = RATE_RE.match(value.lower())
    if not found:
        raise ValueError(
            f"rate {value!r}: write COUNT/UNIT or COUNT/UNIT burst N, e.g. '20/s burst 40', '600/m' or '3600/h'"
        )
    count, unit, burst = float(found.group(1)), found.group(2), found.group(3)
    rate = count / PER_S[unit]
    if rate <= 0:
        raise ValueError(f"rate {value!r}: the count must be above 0 (leave the setting unset for no limit)")
    size = int(burst) if burst is not None else max(1, math.ceil(rate))
    if size < 1:
        raise ValueError(f"rate {value!r}: the burst must be at least 1")
    return rate, size


def default_limit(rate_limit: str | None, max_queued: int) -> TenantLimit:
    """The limit of a tenant with no override, from ``FLEET_RATE_LIMIT`` and ``FLEET_TENANT_MAX_QUEUED``."""
    if rate_limit is None or not rate_limit.strip():
        return TenantLimit(max_queued=max_queued)
    rate, burst = parse_rate(rate_limit)
    return TenantLimit(rate=rate, burst=burst, max_queued=max_queued)


def _override(tenant: str, fields: Any, base: TenantLimit) -> TenantLimit:
    where = f"tenant_limits[{tenant!r}]"
    if not isinstance(fields, dict):
        raise ValueError(f'{where}: expected an object like {{"rate": 100, "burst": 200, "max_queued": 5000}}')
    unknown = sorted(set(fields) - set(LIMIT_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(LIMIT_FIELDS)}")
    limit = base
    if "rate" in fields:
        rate = fields["rate"]
        if isinstance(rate, str):
            parsed, burst = parse_rate(rate)
            limit = replace(limit, rate=parsed, burst=fields.get("burst", burst))
        elif rate is None or (isinstance(rate, int | float) and not isinstance(rate, bool) and rate > 0):
            limit = replace(limit, rate=None if rate is None else float(rate))
            if "burst" not in fields and rate is not None:
                limit = replace(limit, burst=max(1, math.ceil(rate)))
        else:
            raise ValueError(f"{where}.rate: a number of requests per second above 0, '20/s burst 40', or null")
    if "burst" in fields:
        burst = fields["burst"]
        if not isinstance(burst, int) or isinstance(burst, bool) or burst < 1:
            raise ValueError(f"{where}.burst: a whole number of at least 1, got {burst!r}")
        limit = replace(limit, burst=burst)
    if "max_queued" in fields:
        bound = fields["max_queued"]
        if not isinstance(bound, int) or isinstance(bound, bool) or bound < 0:
            raise ValueError(f"{where}.max_queued: a whole number, 0 for no bound, got {bound!r}")
        limit = replace(limit, max_queued=bound)
    return limit


def parse_tenant_limits(value: object) -> dict[str, dict[str, Any]]:
    """``FLEET_TENANT_LIMITS``: a JSON object ``{"teamA": {"rate": 100, "burst": 200, "max_queued": 5000}}``.
    Checked field by field (``build_policy``); raises ValueError naming the tenant and the field."""
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tenant_limits is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError('tenant_limits: expected a JSON object {"TENANT": {"rate": ..., "burst": ..., ...}}')
    for tenant, fields in value.items():
        if not isinstance(tenant, str) or not TENANT_RE.match(tenant):
            raise ValueError(f"tenant_limits: tenant {tenant!r}: use 1-64 letters, digits, '_', '.' or '-'")
        _override(tenant, fields, TenantLimit())
    return value


def build_policy(rate_limit: str | None, max_queued: int, overrides: Mapping[str, Any]) -> LimitPolicy:
    """The policy of the settings (raises ValueError as ``parse_rate`` and ``parse_tenant_limits`` do)."""
    base = default_limit(rate_limit, max_queued)
    return LimitPolicy(base, {tenant: _override(tenant, fields, base) for tenant, fields in overrides.items()})
