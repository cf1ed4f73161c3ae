"""The usage store: jobs, items and device-seconds counted per tenant, model, version and device kind, per hour.

A worker adds what its settled batches counted (``fleet.consumers.usage.usage_of``, gathered by
``fleet.consumers.usage_buffer``) in one call per second at most: in Redis one pipeline (``HINCRBY`` /
``HINCRBYFLOAT`` on the hash of the current hour, ``fleet.constants.usage_key``, and its ``EXPIRE``), never a round
trip per job or per batch under load. ``read`` sums the buckets that overlap a range, also in one
pipeline; a range is widened to whole ``USAGE_BUCKET_S`` buckets and at most ``USAGE_MAX_RANGE_S`` long (the
gateway refuses longer ones before asking), so a query reads at most 744 hashes. Retention: a bucket expires
``USAGE_TTL_S`` (40 days) after its last write; the memory store drops buckets older than that on write.

Hash tags: each hour's hash is its own slot (``{<bucket>}``); a write touches one, and a query's pipeline spans
slots, which the cluster client splits per node (no transaction is needed: each count is one atomic increment).

Counts are sums of increments: two workers settling at once both count, a crash between the results' write and
the usage write loses the usage not yet written (at most a second's, never a job), and a redelivered job whose
record was already terminal counts nothing again (the settler counts only records its own write made terminal).

In memory the same, for ``fleet up`` on the embedded store.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from fleet import constants as c
from fleet.store.redis_errors import RedisErrors, text

if TYPE_CHECKING:
    from fleet.store.redis import RedisStore

_SEP = "|"  # no tenant, model, version or device kind holds one (their patterns forbid it)


@dataclass(frozen=True, slots=True)
class UsageKey:
    """What usage is counted per: the tenant (``default`` for none), the model, its version and the device kind."""

    tenant: str
    model: str
    version: str
    device: str


@dataclass(slots=True)
class UsageCount:
    """Jobs computed, their items (the handler's ``cost`` of each request) and their device-seconds."""

    jobs: int = 0
    items: int = 0
    device_seconds: float = 0.0

    def add(self, other: UsageCount) -> None:
        self.jobs += other.jobs
        self.items += other.items
        self.device_seconds += other.device_seconds


def buckets(start: float, end: float) -> range:
    """The buckets that overlap ``[start, end)`` (unix seconds)."""
    return range(int(start // c.USAGE_BUCKET_S), max(int(start // c.USAGE_BUCKET_S), math.ceil(end / c.USAGE_BUCKET_S)))


class UsageStore(Protocol):
    async def add(self, counts: Mapping[UsageKey, UsageCount], now: float | None = None) -> None:
        """Add ``counts`` to the bucket of ``now`` (default: the time now). Raises ``StoreError`` when unreachable."""

    async def read(self, start: float, end: float) -> dict[UsageKey, UsageCount]:
        """The counts of every bucket that overlaps ``[start, end)``, summed per key."""


def _field(key: UsageKey, metric: str) -> str:
    return _SEP.join((key.tenant, key.model, key.version, key.device, metric))


def _parse_field(field: str) -> tuple[UsageKey, str] | None:
    parts = field.split(_SEP)
    return (UsageKey(*parts[:4]), parts[4]) if len(parts) == 5 else None


class MemoryUsageStore:
    def __init__(self) -> None:
        self._buckets: dict[int, dict[UsageKey, UsageCount]] = {}

    async def add(self, counts: Mapping[UsageKey, UsageCount], now: float | None = None) -> None:
        at = time.time() if now is None else now
        bucket = self._buckets.setdefault(int(at // c.USAGE_BUCKET_S), {})
        for key, count in counts.items():
            bucket.setdefault(key, UsageCount()).add(count)
        oldest = int((at - c.USAGE_TTL_S) // c.USAGE_BUCKET_S)
        for b in [b for b in self._buckets if b < oldest]:
            del self._buckets[b]

    async def read(self, start: float, end: float) -> dict[UsageKey, UsageCount]:
        out: dict[UsageKey, UsageCount] = {}
        for b in buckets(start, end):
            for key, count in self._buckets.get(b, {}).items():
                out.setdefault(key, UsageCount()).add(count)
        return out


class RedisUsageStore:
    """The usage hashes in the Redis of ``store`` (a ``RedisStore``: its client)."""

    def __init__(self, store: RedisStore) -> None:
        self.redis = store.redis
        self.display_url = store.display_url

    async def add(self, counts: Mapping[UsageKey, UsageCount], now: float | None = None) -> None:
        if not counts:
            return
        key = c.usage_key(int((time.time() if now is None else now) // c.USAGE_BUCKET_S))
        async with RedisErrors("usage store", self.display_url, f"count the usage of {len(counts)} groups"):
            pipe = self.redis.pipeline(transaction=False)
            for group, count in counts.items():
                pipe.hincrby(key, _field(group, "jobs"), count.jobs)
                pipe.hincrby(key, _field(group, "items"), count.items)
                pipe.hincrbyfloat(key, _field(group, "ds"), count.device_seconds)
            pipe.expire(key, c.USAGE_TTL_S)
            await pipe.execute()

    async def read(self, start: float, end: float) -> dict[UsageKey, UsageCount]:
        span = buckets(start, end)
        async with RedisErrors("usage store", self.display_url, "read the usage"):
            pipe = self.redis.pipeline(transaction=False)
            for b in span:
                pipe.hgetall(c.usage_key(b))
            rows = await pipe.execute() if len(span) else []
        out: dict[UsageKey, UsageCount] = {}
        for row in rows:
            for raw_field, raw_value in row.items():
                parsed = _parse_field(text(raw_field))
                if parsed is None:
                    continue
                group, metric = parsed
                count = out.setdefault(group, UsageCount())
                value = text(raw_value)
                if metric == "jobs":
                    count.jobs += int(value)
                elif metric == "items":
                    count.items += int(value)
                elif metric == "ds":
                    count.device_seconds += float(value)
        return out
