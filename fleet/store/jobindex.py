"""The job index: which jobs exist, newest first, per tenant and per tenant and model (``GET /v1/jobs``).

Four sorted sets hold each job id, scored by its record's ``created_at`` (unix seconds): its tenant's
(``fleet.constants.job_index_key(tenant)``), its tenant's for its model (``job_index_key(tenant, model)``), and the
same two for every tenant together (``job_index_key(None)``, ``job_index_key(None, model)``: the operator's
listing). A tenant's two keys share the hash tag ``{<tenant>}`` and the all-tenant keys ``{_all}``, so on a Redis
Cluster each pair lives in one slot.

Written where records are born, by the store that writes them, under one contract (``fleet.store.base``):

1. ``create`` (the gateway's submit, a cache hit, a shadow copy; on one Redis inside the same script as the record,
   so a record never exists without its entries; on a cluster, where the index is in other slots, right after);
2. ``start`` / ``finish`` and their batch forms when they create the record (a job published straight to the topic,
   a DAG step): one more command per batch that created some, after the records are written.

A crash between the record and its entries (a cluster, a worker) leaves a record the listing does not show; it is
never the other way round for long, since a page skips (and removes) an entry whose record is gone.

Retention is the record TTL (``job_ttl_s``): writes remove the entries of their keys created more than the TTL ago
(``ZREMRANGEBYSCORE``: each entry is removed once) and give the keys twice the TTL, so an idle tenant's index
disappears after its last record; a create does so at most every quarter TTL per key and store (``Refreshes``). A
record written again later (finished after a long run) lives up to its run time longer than its entry. An entry
whose record expired or was deleted (a submit whose publish failed) is removed when a page reads it (``forget``).

A page (``page``) reads entries strictly after a ``Position`` (a score and the job id: several jobs created in one
batch share a score) in descending order, newest first: a job created after the first page scores higher than
every position handed out, so paging never repeats or skips a job while new ones arrive.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fleet import constants as c
from fleet import tenancy
from fleet.schemas.jobs import JobRecord

# Adds one job's entry to its four keys (KEYS[first..first+3]); with a cutoff ('' : none), also trims them and
# gives them twice the TTL (``Refreshes``).
INDEX_FN = """
local function fleet_index(first, score, member, cutoff, ttl)
  for i = first, first + 3 do
    redis.call('ZADD', KEYS[i], score, member)
    if cutoff ~= '' then
      redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', '(' .. cutoff)
      redis.call('EXPIRE', KEYS[i], tonumber(ttl) * 2)
    end
  end
end
"""
# KEYS: distinct index keys. ARGV: cutoff (unix seconds), ttl_s, then (key number, score, job id) per entry. Adds
# the entries, then trims and re-arms each key once.
INDEX_MANY_LUA = """
for i = 3, #ARGV, 3 do
  redis.call('ZADD', KEYS[tonumber(ARGV[i])], ARGV[i + 1], ARGV[i + 2])
end
for i = 1, #KEYS do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', '(' .. ARGV[1])
  redis.call('EXPIRE', KEYS[i], tonumber(ARGV[2]) * 2)
end
return 1
"""
READ_CHUNK = 500  # entries one ZREVRANGEBYSCORE reads at most
REFRESH_SHARE = 0.25  # a store trims and re-arms an index key it writes at least this share of the TTL apart
REFRESHES_KEPT = 65_536  # index keys whose last refresh one store remembers
TRIM_AT = 1024  # the in-memory index cuts its stale head once it is this long (or an eighth of the list)


@dataclass(frozen=True, slots=True)
class Position:
    """An entry of the index: where a page stopped, or a job it found."""

    score: float
    job_id: str


@dataclass(frozen=True, slots=True)
class Scope:
    """Which index a listing reads: one tenant's (None: every tenant's), one model's (None: all)."""

    tenant: str | None
    model: str | None = None

    @property
    def key(self) -> str:
        return c.job_index_key(self.tenant, self.model)


class Refreshes:
    """When this store last trimmed and re-armed each index key it writes (a bounded LRU of key -> unix seconds).

    A trim and an ``EXPIRE`` on every create would double what a create costs Redis (measured: 17 -> 35 us per
    script), so a create script does them only when ``due``: for a key this store has not refreshed within
    ``REFRESH_SHARE`` of the TTL. The keys get twice the TTL, so a key lives at least 1.75 TTLs past the last write of
    any store (whose last refresh of it was at most a quarter TTL before), longer than that write's record; and a
    key holds at most 1.25 TTLs of entries between trims (a page skips the stale ones meanwhile).
    """

    def __init__(self, ttl_s: int) -> None:
        self.every_s = ttl_s * REFRESH_SHARE
        self._last: OrderedDict[str, float] = OrderedDict()

    def due(self, keys: list[str], now: float) -> bool:
        """True (and the keys marked refreshed now) when one of ``keys`` is due."""
        last = self._last
        if all(now - last.get(key, -math.inf) < self.every_s for key in keys):
            return False
        for key in keys:
            last[key] = now
            last.move_to_end(key)
        while len(last) > REFRESHES_KEPT:
            last.popitem(last=False)
        return True


def index_keys(record: JobRecord) -> list[str]:
    """The four keys that hold ``record``'s entry: its tenant's, its tenant's model's, every tenant's, the model's."""
    tenant = tenancy.owner(record.tenant)
    return [
        c.job_index_key(tenant),
        c.job_index_key(tenant, record.model),
        c.job_index_key(None),
        c.job_index_key(None, record.model),
    ]


def score_arg(value: float) -> str:
    """A score as Redis reads it back exactly (``repr`` of a float round-trips)."""
    return repr(float(value))


def index_many_args(records: Iterable[JobRecord], ttl_s: int, now: float) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of ``INDEX_MANY_LUA`` for ``records`` (every key named once)."""
    keys: dict[str, int] = {}
    args: list[Any] = [score_arg(now - ttl_s), ttl_s]
    for record in records:
        for key in index_keys(record):
            number = keys.setdefault(key, len(keys) + 1)
            args += [number, score_arg(record.created_at), record.job_id]
    return list(keys), args


def hash_tag(key: str) -> str:
    """The ``{...}`` part of an index key: keys with the same tag share a cluster slot."""
    return key[key.index("{") : key.index("}") + 1]


def after(entries: list[Position], position: Position | None) -> list[Position]:
    """``entries`` (descending) less those at or before ``position`` in that order: a prefix of ties at its score
    whose job ids sort at or above its own."""
    if position is None:
        return entries
    skip = 0
    for entry in entries:
        if entry.score < position.score or (entry.score == position.score and entry.job_id < position.job_id):
            break
        skip += 1
    return entries[skip:]


def bounds(since: float | None, until: float | None, position: Position | None) -> tuple[float, float]:
    """The score range (high, low) a page reads: from the position (or ``until``) down to ``since``."""
    high = math.inf if until is None else until
    if position is not None:
        high = min(high, position.score)
    return high, -math.inf if since is None else since


class MemoryIndex:
    """The index of the in-memory store: per key, a list of (score, job id) kept sorted ascending. Stale entries
    are cut from the head in steps (``TRIM_AT``); until then a page skips them as entries whose record is gone."""

    def __init__(self, ttl_s: int) -> None:
        self.ttl_s = ttl_s
        self._keys: dict[str, list[tuple[float, str]]] = {}

    def add(self, record: JobRecord) -> None:
        cutoff = time.time() - self.ttl_s
        entry = (record.created_at, record.job_id)
        for key in index_keys(record):
            entries = self._keys.setdefault(key, [])
            bisect.insort(entries, entry)
            stale = bisect.bisect_left(entries, (cutoff, ""))
            if stale >= TRIM_AT or stale * 8 >= len(entries):  # in steps: each cut moves the whole list
                del entries[:stale]

    def page(
        self, scope: Scope, since: float | None, until: float | None, position: Position | None, count: int
    ) -> list[Position]:
        entries = self._keys.get(scope.key, [])
        high, low = bounds(since, until, position)
        stop = bisect.bisect_right(entries, (high, "\U0010ffff"))
        if position is not None and position.score <= high:
            stop = min(stop, bisect.bisect_left(entries, (position.score, position.job_id)))
        out: list[Position] = []
        for i in range(stop - 1, -1, -1):
            score, job_id = entries[i]
            if score < low or len(out) >= count:
                break
            out.append(Position(score, job_id))
        return out

    def forget(self, scope: Scope, positions: list[Position]) -> None:
        entries = self._keys.get(scope.key)
        if entries is None:
            return
        for p in positions:
            i = bisect.bisect_left(entries, (p.score, p.job_id))
            if i < len(entries) and entries[i] == (p.score, p.job_id):
                del entries[i]
