"""Per-tenant rate limits and queued-job quotas, decided atomically in Redis (or in memory for ``fleet up``).

Policy (``fleet.limit_policy.LimitPolicy``, from ``FLEET_RATE_LIMIT``, ``FLEET_TENANT_MAX_QUEUED`` and
``FLEET_TENANT_LIMITS``): every tenant gets the default ``TenantLimit`` unless ``FLEET_TENANT_LIMITS`` names it;
an override's fields win over the default's, the ones it leaves out are inherited.

Rate: GCRA (the generic cell rate algorithm, a token bucket kept as one number). A tenant's key
``rate_key(tenant)`` holds its *theoretical arrival time* (TAT) in microseconds of Redis's own clock
(``redis.call('TIME')``), so the gateways' clocks never matter. With ``rate`` r per second and ``burst`` b, each
admitted request moves the TAT on by ``1/r``; a request is admitted while the TAT is at most ``(b - 1)/r`` ahead
of now: b at once from rest, then r per second.

Quota: ``queued_key(tenant)`` is a sorted set of the tenant's queued job ids, each scored by when its *hold* ends
(its deadline plus a slack, or the record's TTL). A job is counted when it is admitted and leaves the set when

* a worker settles it (``release``: one pipelined call per batch, from ``fleet.consumers.settle``), or
* its hold ends: members past their score are trimmed by the admission script itself, or
* a sweep finds its record terminal or gone: a tenant at its bound has the records of its oldest members re-read
  (at most once a second per gateway, ``fleet.constants.QUOTA_SWEEP_INTERVAL_S``) and the ended ones removed, so a
  job that ended where no release ran (a client's cancel, a crash between the store write and the release, a
  worker without the quota settings) frees its place without waiting for its hold.

A crash anywhere leaks a place for at most the job's hold, never forever.

Both keys carry the hash tag ``{tenant}``: one slot on Redis Cluster, so one script (``ADMIT_LUA``) checks the
rate and the quota together, and a request refused by either consumes neither. On one Redis a submit's decision
and its record's creation are one script too (``ADMIT_CREATE_LUA``: the decision, then the store's own create
script only when it admits); on a cluster, where the job's key and the tenant's are in different slots, they are
two calls, and a failed create gives its place back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from fleet import constants as c
from fleet.errors import StoreError
from fleet.limit_policy import TenantLimit
from fleet.schemas.jobs import JobRecord
from fleet.store.base import ResultStore
from fleet.store.redis import CREATE_PENDING_LUA, RedisStore
from fleet.store.redis_errors import RedisErrors, text

log = logging.getLogger(__name__)


ADMITTED, RATE_LIMITED, QUOTA_EXCEEDED = 1, 0, 2

# KEYS: rate key, queued key. ARGV: interval in microseconds (0: no rate), burst, max queued (0: no bound), job id
# ('' : rate only), hold in seconds. Returns {verdict, remaining, reset_ms, retry_ms, queued, added}: verdict 1
# admitted, 0 rate limited, 2 quota exceeded; remaining admits left in the burst (-1: no rate); reset_ms until the
# burst is whole again; retry_ms until the next admit could pass; queued the tenant's count (-1: not counted);
# added 1 when this call put the job id in the set (0: it was there already, or not counted).
# ``ADMIT_FN`` is that decision as a Lua function of (rate key, queued key, ARGV...), so that ``ADMIT_CREATE_LUA``
# can run it in front of the store's own create script.
ADMIT_FN = """
local function fleet_admit(rate_key, queued_key, interval, burst, max_queued, job_id, hold)
interval, burst, max_queued, hold = tonumber(interval), tonumber(burst), tonumber(max_queued), tonumber(hold)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local remaining, reset, tat = -1, 0, now
if interval > 0 then
  tat = tonumber(redis.call('GET', rate_key) or now)
  if tat < now then tat = now end
  local allow_at = tat + interval - burst * interval
  if now < allow_at then
    return {0, 0, math.ceil((tat - now) / 1000), math.ceil((allow_at - now) / 1000), -1, 0}
  end
  tat = tat + interval
  remaining = math.floor((now - allow_at) / interval)
  reset = math.ceil((tat - now) / 1000)
end
local queued, added = -1, 0
if job_id ~= '' and max_queued > 0 then
  redis.call('ZREMRANGEBYSCORE', queued_key, '-inf', now / 1000000)
  queued = redis.call('ZCARD', queued_key)
  if not redis.call('ZSCORE', queued_key, job_id) then
    if queued >= max_queued then return {2, remaining, reset, 1000, queued, 0} end
    redis.call('ZADD', queued_key, now / 1000000 + hold, job_id)
    if redis.call('TTL', queued_key) < hold then redis.call('EXPIRE', queued_key, math.ceil(hold) + 1) end
    queued, added = queued + 1, 1
  end
end
if interval > 0 then
  redis.call('SET', rate_key, string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1000)
end
return {1, remaining, reset, 0, queued, added}
end
"""
ADMIT_LUA = ADMIT_FN + "return fleet_admit(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])\n"
# KEYS: the store's job key, pending set, message key and four job index keys, then the rate key and the queued key.
# ARGV: the store's create arguments (record, ttl_s, job id, message, created_at, index cutoff), then ADMIT_LUA's
# five. One round trip for a submit on one
# Redis: the decision, and only when it admits, the store's own create (``CREATE_PENDING_LUA``, unchanged).
# Returns ADMIT_LUA's six numbers and a seventh: 1 if the record was created (0: refused, or it existed).
ADMIT_CREATE_LUA = (
    ADMIT_FN
    + "local function create()\n"
    + CREATE_PENDING_LUA
    + "end\n"
    + """
local d = fleet_admit(KEYS[8], KEYS[9], ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11])
if d[1] ~= 1 then d[7] = 0 return d end
d[7] = create()
return d
"""
)


@dataclass(frozen=True, slots=True)
class Decision:
    """What ``decide`` decided, with what the ``RateLimit-*`` headers say. ``remaining`` is -1 without a rate."""

    verdict: int
    limit: TenantLimit
    remaining: int = -1
    reset_s: float = 0.0
    retry_after_s: float = 0.0
    queued: int = -1
    added: bool = False

    @property
    def admitted(self) -> bool:
        return self.verdict == ADMITTED


def hold_s(expires_at: float | None, now: float, job_ttl_s: float) -> float:
    """How long a job may count against its tenant: until its deadline (and a slack), at most its record's TTL."""
    if expires_at is None:
        return float(job_ttl_s)
    return max(1.0, min(float(job_ttl_s), expires_at - now + c.QUOTA_HOLD_SLACK_S))


def decision_of(reply: list[Any], limit: TenantLimit) -> Decision:
    verdict, remaining, reset_ms, retry_ms, queued, added = (int(x) for x in reply)
    return Decision(verdict, limit, remaining, reset_ms / 1000, retry_ms / 1000, queued, bool(added))


def group_by_tenant(items: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for tenant, job_id in items:
        out.setdefault(tenant, []).append(job_id)
    return out


# -- stores ---------------------------------------------------------------------------------------------------
class Quotas(Protocol):
    """Contract (``tests/test_quotas.py`` runs it on Redis and in memory): ``decide`` decides and, when it admits,
    takes a place for ``job_id`` (None: the rate alone); ``decide_and_create`` decides for ``job`` (a place in its quota
    when ``limit`` has one, held ``hold_s``) and, only when it admits, creates it in ``store`` as
    ``store.create(job, message)`` does, returning (the decision, whether the record was created); ``release``
    frees the places of (tenant, job id) pairs in one call; ``members`` lists a tenant's oldest queued ids;
    ``forget`` removes some of them."""

    async def decide(self, tenant: str, limit: TenantLimit, job_id: str | None, hold_s: float) -> Decision: ...

    async def decide_and_create(
        self,
        store: ResultStore,
        tenant: str,
        limit: TenantLimit,
        hold_s: float,
        job: JobRecord,
        message: bytes,
    ) -> tuple[Decision, bool]: ...

    async def release(self, items: list[tuple[str, str]]) -> None: ...

    async def members(self, tenant: str, limit: int) -> list[str]: ...

    async def forget(self, tenant: str, job_ids: list[str]) -> None: ...


class TwoCalls:
    """``decide_and_create`` as two calls: the decision, then ``store.create`` when it admitted (the in-memory limits,
    and Redis limits beside a store they cannot share a script with)."""

    async def decide_and_create(
        self: Quotas,
        store: ResultStore,
        tenant: str,
        limit: TenantLimit,
        hold_s: float,
        job: JobRecord,
        message: bytes,
    ) -> tuple[Decision, bool]:
        decision = await self.decide(tenant, limit, job.job_id if limit.max_queued > 0 else None, hold_s)
        if not decision.admitted:
            return decision, False
        try:
            return decision, await store.create(job, message)
        except BaseException:  # no record, so no queued job: the place goes back now (not with the job's hold)
            if decision.added:
                await asyncio.shield(release_quietly(self, [(tenant, job.job_id)]))
            raise


class RedisQuotas(TwoCalls):
    """The limits in the Redis of ``store`` (a ``RedisStore``: its client): one ``ADMIT_LUA`` call per decision, and
    on one Redis one ``ADMIT_CREATE_LUA`` call per submit (a cluster has the job and the tenant in different slots:
    two calls there)."""

    def __init__(self, store: RedisStore) -> None:
        self.redis = store.redis
        self.display_url = store.display_url
        self._decide = self.redis.register_script(ADMIT_LUA)
        self._decide_and_create = None if store.cluster_mode else self.redis.register_script(ADMIT_CREATE_LUA)
        from redis.exceptions import RedisError

        self._failures = (RedisError, OSError, TimeoutError)

    async def decide(self, tenant: str, limit: TenantLimit, job_id: str | None, hold_s: float) -> Decision:
        args = [limit.interval_us, limit.burst, limit.max_queued, job_id or "", f"{hold_s:.3f}"]
        try:  # on every submit: a plain try, not RedisErrors (whose exit imports and checks on each call)
            reply = await self._decide(keys=[c.rate_key(tenant), c.queued_key(tenant)], args=args)
        except self._failures as exc:
            raise StoreError(f"rate limiter at {self.display_url} could not check a tenant's limits: {exc}") from exc
        return decision_of(reply, limit)

    async def decide_and_create(
        self,
        store: ResultStore,
        tenant: str,
        limit: TenantLimit,
        hold_s: float,
        job: JobRecord,
        message: bytes,
    ) -> tuple[Decision, bool]:
        # one script reaches the job's key and the tenant's only on one Redis, the one of these limits
        if self._decide_and_create is None or not isinstance(store, RedisStore) or store.redis is not self.redis:
            return await super().decide_and_create(store, tenant, limit, hold_s, job, message)
        job_id = job.job_id
        keys, args = store.pending_create(job, message)
        keys += [c.rate_key(tenant), c.queued_key(tenant)]
        args += [limit.interval_us, limit.burst, limit.max_queued, job_id if limit.max_queued else "", f"{hold_s:.3f}"]
        try:
            reply = await self._decide_and_create(keys=keys, args=args)
        except self._failures as exc:
            raise StoreError(f"result store at {self.display_url} could not create job {job_id!r}: {exc}") from exc
        return decision_of(reply[:6], limit), reply[6] == 1

    async def release(self, items: list[tuple[str, str]]) -> None:
        if not items:
            return
        async with RedisErrors("rate limiter", self.display_url, "release queued jobs"):
            async with self.redis.pipeline(transaction=False) as pipe:
                for tenant, ids in group_by_tenant(items).items():
                    pipe.zrem(c.queued_key(tenant), *ids)
                await pipe.execute()

    async def members(self, tenant: str, limit: int) -> list[str]:
        async with RedisErrors("rate limiter", self.display_url, "read a tenant's queued jobs"):
            ids = await self.redis.zrange(c.queued_key(tenant), 0, max(0, limit - 1))
        return [text(i) for i in ids]

    async def forget(self, tenant: str, job_ids: list[str]) -> None:
        if job_ids:
            async with RedisErrors("rate limiter", self.display_url, "release queued jobs"):
                await self.redis.zrem(c.queued_key(tenant), *job_ids)


class MemoryQuotas(TwoCalls):
    """The same contract in one process (``fleet up`` on the embedded store), on ``time.time()``."""

    def __init__(self, clock: Any = time.time) -> None:
        self.clock = clock
        self._tat: dict[str, float] = {}
        self._queued: dict[str, dict[str, float]] = {}  # tenant -> job id -> hold end

    async def decide(self, tenant: str, limit: TenantLimit, job_id: str | None, hold_s: float) -> Decision:
        now = self.clock()
        interval = limit.interval_us / 1_000_000
        remaining, reset, tat = -1, 0.0, max(now, self._tat.get(tenant, now))
        if interval > 0:
            allow_at = tat + interval - limit.burst * interval
            if now < allow_at:
                return Decision(RATE_LIMITED, limit, 0, tat - now, allow_at - now)
            tat += interval
            remaining, reset = math.floor((now - allow_at) / interval + 1e-9), tat - now
        queued, added = -1, False
        if job_id is not None and limit.max_queued > 0:
            held = self._queued.setdefault(tenant, {})
            for gone in [i for i, until in held.items() if until <= now]:
                del held[gone]
            queued = len(held)
            if job_id not in held:
                if queued >= limit.max_queued:
                    return Decision(QUOTA_EXCEEDED, limit, remaining, reset, 1.0, queued)
                held[job_id] = now + hold_s
                queued, added = queued + 1, True
        if interval > 0:
            self._tat[tenant] = tat
        return Decision(ADMITTED, limit, remaining, reset, 0.0, queued, added)

    async def release(self, items: list[tuple[str, str]]) -> None:
        for tenant, ids in group_by_tenant(items).items():
            held = self._queued.get(tenant, {})
            for job_id in ids:
                held.pop(job_id, None)

    async def members(self, tenant: str, limit: int) -> list[str]:
        held = self._queued.get(tenant, {})
        return [i for i, _ in sorted(held.items(), key=lambda item: item[1])][: max(0, limit)]

    async def forget(self, tenant: str, job_ids: list[str]) -> None:
        await self.release([(tenant, job_id) for job_id in job_ids])


def tenant_of_record(record: Any) -> str:
    """The tenant a job record belongs to (``default`` for a record that names none)."""
    return getattr(record, "tenant", None) or c.DEFAULT_TENANT


async def release_quietly(quotas: Quotas, items: list[tuple[str, str]]) -> None:
    """``release``, never raising and bounded by ``QUOTA_RELEASE_TIMEOUT_S``: the settle path calls it after its
    acks, where a Redis hiccup must not touch the jobs (their places then come back by a sweep or the hold)."""
    try:
        async with asyncio.timeout(c.QUOTA_RELEASE_TIMEOUT_S):
            await quotas.release(items)
    except Exception as exc:
        log.warning("could not release %d queued-job places (%s); a sweep or their holds free them", len(items), exc)
