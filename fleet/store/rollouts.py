"""The rollouts store: each model's traffic policy with its controller's and breakers' state, the controller's
decisions, and the per-version outcome counts and shadow agreement the controller judges.

One document per model (``RolloutDoc``) under ``fleet:rollout:<model>``, written by compare-and-set on its
``revision`` (``write`` returns False when another writer got there first: read again and redo), so a person's
change through the API and the controller's step never overwrite each other. Gateways read it on their request path
(through a short-lived cache of their own); the controller (``fleet.lifecycle.service``) and the API write it.

Decisions: a capped list per model, newest first (``fleet:rollout:<model>:decisions``), for the dashboard's timeline.

Comparisons: a capped list per model, newest first (``fleet:rollout:<model>:comparisons``, ``COMPARISONS_KEPT``), of
the shadow comparisons the settle hook made (``ComparisonEntry``: both jobs, versions, outputs' digests and the
score), for ``GET /v1/models/{name}/comparisons``.

Measurements: outcomes (succeeded or failed, and latency) and shadow agreement scores are counted per model, version
and ``STATS_BUCKET_S`` bucket of wall-clock time (``fleet:rollout:<model>:stats:<version>:<bucket>``, a hash that
expires after ``STATS_TTL_S``), by the settle hook of the workers; ``window`` sums the buckets of the last
``window_s`` into ``WindowStats``. Latencies are counted in logarithmic buckets (ratio ``LATENCY_RATIO``), so p99 is
known within 10 %. ``claim_comparison`` is a set-if-absent marker, so a shadow and its primary that settle at the
same moment compare their outputs once.

Tally: ``record_outcome`` also keeps each version's running tally (``fleet:rollout:<model>:tally:<version>``, a hash:
failures in a row, outcomes and failures in all, the times of the latest success and failure), which the breakers
of ``fleet.lifecycle.service`` are judged on (``tally``). Concurrent settles may interleave a streak's reset and
increment; the streak is then one off for one outcome, which a breaker's threshold of several absorbs.

Lock: ``acquire_lock(owner, ttl_s)`` takes or renews the one lock of the rollout controllers (``ROLLOUT_LOCK_KEY``,
the owner's id with a TTL; renewed and released only by its holder), so one controller acts per Redis.

In memory the same, for ``fleet up`` on the embedded store.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from fleet import constants as c
from fleet.lifecycle.breaker import BreakerConfig, BreakerState
from fleet.lifecycle.breaker_counts import Tally
from fleet.lifecycle.controller import RolloutConfig, RolloutState
from fleet.lifecycle.traffic import TrafficPolicy
from fleet.store.redis_errors import RedisErrors

if TYPE_CHECKING:
    from fleet.store.redis import RedisStore

STATS_BUCKET_S = 10
STATS_TTL_S = 3600
DECISIONS_KEPT = 200
LATENCY_RATIO = 1.1  # latency buckets: [1.1^i, 1.1^(i+1)) ms
COMPARISON_TTL_S = 3600
COMPARISONS_KEPT = 200


class RolloutDoc(BaseModel):
    """A model's traffic policy and what its controller and breakers remember."""

    model_config = ConfigDict(extra="forbid")

    model: str
    policy: TrafficPolicy
    rollout: RolloutConfig | None = Field(None, description="null: no automatic rollout (weights move by hand)")
    state: RolloutState = Field(default_factory=RolloutState, description="the controller's memory")
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    breakers: dict[str, BreakerState] = Field(default_factory=dict, description="per version")
    revision: int = 0
    updated_at: float = Field(default_factory=time.time)
    updated_by: str | None = None


class DecisionEntry(BaseModel):
    """One line of the timeline: the controller's decision, a person's change, or a breaker's transition."""

    at: float
    model: str
    action: str  # hold, step, promote, roll_back, set (a person's policy change), breaker
    weight: float | None = None
    previous_weight: float | None = None
    version: str | None = None
    reason: str
    by: str = "controller"


class ComparisonEntry(BaseModel):
    """One shadow comparison: the primary's answer against the shadow version's, by the runtime's measure."""

    at: float
    model: str
    job_id: str = Field(description="the primary job (the one whose output the client got)")
    shadow_job_id: str
    version: str | None = Field(description="the version that answered the client")
    shadow_version: str | None
    runtime: str | None = Field(description="whose measure scored it (null: exact equality)")
    output_digest: str | None = Field(description="sha256 of the primary output's canonical JSON (null: no output)")
    shadow_output_digest: str | None
    score: float | None = Field(description="agreement in 0..1 (null: not comparable, see 'note')")
    note: str | None = Field(None, description="why there is no score: a side failed, or an output of another shape")


@dataclass(frozen=True, slots=True)
class Outcome:
    """One settled job, counted for its model version (``record_outcomes``)."""

    model: str
    version: str
    ok: bool
    latency_ms: float | None


@dataclass(frozen=True, slots=True)
class WindowStats:
    """One version's outcomes and shadow agreement over a window."""

    requests: int = 0
    failures: int = 0
    p99_ms: float | None = None
    agreement: float | None = None  # mean agreement score of this version's shadow outputs with the primary's
    agreement_samples: int = 0

    @property
    def error_rate(self) -> float:
        return self.failures / self.requests if self.requests else 0.0


def latency_bucket(ms: float) -> int:
    return max(0, math.floor(math.log(max(ms, 1.0), LATENCY_RATIO)))


def bucket_upper_ms(index: int) -> float:
    return float(LATENCY_RATIO ** (index + 1))


def summarize(counts: dict[str, float]) -> WindowStats:
    """``WindowStats`` of summed bucket counts (fields ``ok``, ``failed``, ``lat:<i>``, ``agree_sum``, ``agree_n``)."""
    requests = int(counts.get("ok", 0) + counts.get("failed", 0))
    latencies = sorted((int(k[4:]), int(v)) for k, v in counts.items() if k.startswith("lat:") and v)
    p99 = None
    total = sum(n for _, n in latencies)
    if total:
        rank = math.ceil(0.99 * total)
        seen = 0
        for index, n in latencies:
            seen += n
            if seen >= rank:
                p99 = bucket_upper_ms(index)
                break
    samples = int(counts.get("agree_n", 0))
    agreement = counts.get("agree_sum", 0.0) / samples if samples else None
    return WindowStats(requests, int(counts.get("failed", 0)), p99, agreement, samples)


def _stats_fields(ok: bool, latency_ms: float | None) -> dict[str, int]:
    fields = {"ok" if ok else "failed": 1}
    if latency_ms is not None:
        fields[f"lat:{latency_bucket(latency_ms)}"] = 1
    return fields


class RolloutStore(Protocol):
    async def read(self, model: str) -> RolloutDoc | None: ...

    async def write(self, doc: RolloutDoc, expected_revision: int) -> bool:
        """Store ``doc`` with revision ``expected_revision + 1`` if the stored one is still ``expected_revision``
        (0: none stored). False: someone else wrote first."""
        ...

    async def delete(self, model: str) -> None: ...

    async def models(self) -> list[str]: ...

    async def add_decision(self, entry: DecisionEntry) -> None: ...

    async def decisions(self, model: str, limit: int = 50) -> list[DecisionEntry]: ...

    async def record_outcome(
        self, model: str, version: str, ok: bool, latency_ms: float | None, now: float | None = None
    ) -> None: ...

    async def record_agreement(self, model: str, version: str, score: float, now: float | None = None) -> None: ...

    async def window(
        self, model: str, versions: list[str], window_s: float, now: float | None = None
    ) -> dict[str, WindowStats]: ...

    async def claim_comparison(self, model: str, job_id: str) -> bool: ...

    async def tally(self, model: str, versions: list[str]) -> dict[str, Tally]: ...

    async def acquire_lock(self, owner: str, ttl_s: float) -> bool:
        """Take the controllers' lock when free or lapsed, renew it when ``owner`` holds it; False: another holds it."""
        ...

    async def release_lock(self, owner: str) -> None: ...

    async def record_outcomes(self, outcomes: list[Outcome], now: float | None = None) -> None:
        """``record_outcome`` of each, in one round trip."""
        ...

    async def add_comparison(self, entry: ComparisonEntry) -> None: ...

    async def comparisons(self, model: str, limit: int = 50) -> list[ComparisonEntry]:
        """The model's recent comparisons, newest first."""
        ...


def _tallied(tally: Tally, ok: bool, at: float) -> Tally:
    if ok:
        return Tally(0, tally.total + 1, tally.failed, at, tally.last_failed_at)
    return Tally(tally.streak + 1, tally.total + 1, tally.failed + 1, tally.last_ok_at, at)


def _tally_of(row: dict[Any, Any]) -> Tally:
    fields = {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in row.items()}
    return Tally(
        int(fields.get("streak", 0)),
        int(fields.get("total", 0)),
        int(fields.get("failed", 0)),
        fields.get("ok_at"),
        fields.get("failed_at"),
    )


def _buckets(window_s: float, now: float) -> range:
    last = int(now // STATS_BUCKET_S)
    return range(last - max(1, math.ceil(window_s / STATS_BUCKET_S)) + 1, last + 1)


def _next(doc: RolloutDoc, expected_revision: int) -> RolloutDoc:
    return doc.model_copy(update={"revision": expected_revision + 1})


class MemoryRolloutStore:
    def __init__(self) -> None:
        self._docs: dict[str, str] = {}
        self._decisions: dict[str, deque[str]] = defaultdict(lambda: deque(maxlen=DECISIONS_KEPT))
        self._stats: dict[tuple[str, str, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._claims: dict[tuple[str, str], float] = {}
        self._tallies: dict[tuple[str, str], Tally] = {}
        self._lock_owner: str | None = None
        self._lock_until = 0.0
        self._comparisons: dict[str, deque[str]] = defaultdict(lambda: deque(maxlen=COMPARISONS_KEPT))

    async def read(self, model: str) -> RolloutDoc | None:
        raw = self._docs.get(model)
        return RolloutDoc.model_validate_json(raw) if raw is not None else None

    async def write(self, doc: RolloutDoc, expected_revision: int) -> bool:
        current = self._docs.get(doc.model)
        revision = RolloutDoc.model_validate_json(current).revision if current is not None else 0
        if revision != expected_revision:
            return False
        self._docs[doc.model] = _next(doc, expected_revision).model_dump_json()
        return True

    async def delete(self, model: str) -> None:
        self._docs.pop(model, None)

    async def models(self) -> list[str]:
        return sorted(self._docs)

    async def add_decision(self, entry: DecisionEntry) -> None:
        self._decisions[entry.model].appendleft(entry.model_dump_json())

    async def decisions(self, model: str, limit: int = 50) -> list[DecisionEntry]:
        return [DecisionEntry.model_validate_json(raw) for raw in list(self._decisions[model])[: max(0, limit)]]

    async def record_outcome(
        self, model: str, version: str, ok: bool, latency_ms: float | None, now: float | None = None
    ) -> None:
        at = now or time.time()
        counts = self._stats[(model, version, int(at // STATS_BUCKET_S))]
        for field, n in _stats_fields(ok, latency_ms).items():
            counts[field] += n
        self._tallies[(model, version)] = _tallied(self._tallies.get((model, version), Tally()), ok, at)

    async def record_agreement(self, model: str, version: str, score: float, now: float | None = None) -> None:
        counts = self._stats[(model, version, int((now or time.time()) // STATS_BUCKET_S))]
        counts["agree_sum"] += score
        counts["agree_n"] += 1

    async def window(
        self, model: str, versions: list[str], window_s: float, now: float | None = None
    ) -> dict[str, WindowStats]:
        out = {}
        for version in versions:
            summed: dict[str, float] = defaultdict(float)
            for b in _buckets(window_s, now or time.time()):
                for field, n in self._stats.get((model, version, b), {}).items():
                    summed[field] += n
            out[version] = summarize(summed)
        return out

    async def claim_comparison(self, model: str, job_id: str) -> bool:
        now = time.time()
        if len(self._claims) > 100_000:
            self._claims = {k: t for k, t in self._claims.items() if t > now}
        if self._claims.get((model, job_id), 0.0) > now:
            return False
        self._claims[(model, job_id)] = now + COMPARISON_TTL_S
        return True

    async def tally(self, model: str, versions: list[str]) -> dict[str, Tally]:
        return {v: self._tallies.get((model, v), Tally()) for v in versions}

    async def acquire_lock(self, owner: str, ttl_s: float) -> bool:
        now = time.monotonic()
        if self._lock_owner not in (None, owner) and now < self._lock_until:
            return False
        self._lock_owner, self._lock_until = owner, now + ttl_s
        return True

    async def release_lock(self, owner: str) -> None:
        if self._lock_owner == owner:
            self._lock_owner, self._lock_until = None, 0.0

    async def record_outcomes(self, outcomes: list[Outcome], now: float | None = None) -> None:
        for o in outcomes:
            await self.record_outcome(o.model, o.version, o.ok, o.latency_ms, now)

    async def add_comparison(self, entry: ComparisonEntry) -> None:
        self._comparisons[entry.model].appendleft(entry.model_dump_json())

    async def comparisons(self, model: str, limit: int = 50) -> list[ComparisonEntry]:
        rows = list(self._comparisons.get(model, ()))[: max(0, limit)]
        return [ComparisonEntry.model_validate_json(raw) for raw in rows]


def _count_tally(pipe: Any, key: str, ok: bool, at: float) -> None:
    """Queue the updates of a version's tally (``Tally``) for one outcome at ``at`` on ``pipe``."""
    pipe.hincrby(key, "total", 1)
    if ok:
        pipe.hset(key, mapping={"streak": 0, "ok_at": repr(at)})
    else:
        pipe.hincrby(key, "streak", 1)
        pipe.hincrby(key, "failed", 1)
        pipe.hset(key, "failed_at", repr(at))
    pipe.expire(key, STATS_TTL_S)


_CAS = """
local current = redis.call('GET', KEYS[1])
local revision = 0
if current then revision = cjson.decode(current)['revision'] end
if revision ~= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisRolloutStore:
    """The rollouts keys in the Redis of ``store`` (a ``RedisStore``: its client)."""

    def __init__(self, store: RedisStore) -> None:
        self.redis = store.redis
        self.display_url = store.display_url
        self._cas: Any = self.redis.register_script(_CAS)
        self._renew: Any = self.redis.register_script(_RENEW)
        self._release: Any = self.redis.register_script(_RELEASE)

    def _errors(self, what: str) -> RedisErrors:
        return RedisErrors("rollouts", self.display_url, what)

    async def read(self, model: str) -> RolloutDoc | None:
        async with self._errors(f"read the traffic policy of {model}"):
            raw = await self.redis.get(c.rollout_key(model))
        return RolloutDoc.model_validate_json(raw) if raw is not None else None

    async def write(self, doc: RolloutDoc, expected_revision: int) -> bool:
        body = _next(doc, expected_revision).model_dump_json()
        async with self._errors(f"write the traffic policy of {doc.model}"):
            done = await self._cas(keys=[c.rollout_key(doc.model)], args=[expected_revision, body])
            if done:
                await self.redis.sadd(c.ROLLOUT_MODELS_KEY, doc.model)
        return bool(done)

    async def delete(self, model: str) -> None:
        async with self._errors(f"delete the traffic policy of {model}"):
            await self.redis.delete(c.rollout_key(model))
            await self.redis.srem(c.ROLLOUT_MODELS_KEY, model)

    async def models(self) -> list[str]:
        async with self._errors("list the models with traffic policies"):
            names = await self.redis.smembers(c.ROLLOUT_MODELS_KEY)
        return sorted(n.decode() if isinstance(n, bytes) else n for n in names)

    async def add_decision(self, entry: DecisionEntry) -> None:
        key = c.rollout_decisions_key(entry.model)
        async with self._errors(f"record a decision of {entry.model}"):
            await self.redis.lpush(key, entry.model_dump_json())
            await self.redis.ltrim(key, 0, DECISIONS_KEPT - 1)

    async def decisions(self, model: str, limit: int = 50) -> list[DecisionEntry]:
        async with self._errors(f"read the decisions of {model}"):
            rows = await self.redis.lrange(c.rollout_decisions_key(model), 0, max(0, limit) - 1) if limit > 0 else []
        return [DecisionEntry.model_validate_json(raw) for raw in rows]

    async def _count(self, model: str, version: str, fields: dict[str, float], now: float | None) -> None:
        key = c.rollout_stats_key(model, version, int((now or time.time()) // STATS_BUCKET_S))
        async with self._errors(f"count an outcome of {model}@{version}"):
            pipe = self.redis.pipeline(transaction=False)
            for field, n in fields.items():
                if isinstance(n, int):
                    pipe.hincrby(key, field, n)
                else:
                    pipe.hincrbyfloat(key, field, n)
            pipe.expire(key, STATS_TTL_S)
            await pipe.execute()

    async def record_outcome(
        self, model: str, version: str, ok: bool, latency_ms: float | None, now: float | None = None
    ) -> None:
        at = now or time.time()
        key = c.rollout_stats_key(model, version, int(at // STATS_BUCKET_S))
        tally = c.rollout_tally_key(model, version)  # the breaker's: failures in a row, totals, latest times
        async with self._errors(f"count an outcome of {model}@{version}"):
            pipe = self.redis.pipeline(transaction=False)
            for field, n in _stats_fields(ok, latency_ms).items():
                pipe.hincrby(key, field, n)
            pipe.expire(key, STATS_TTL_S)
            _count_tally(pipe, tally, ok, at)
            await pipe.execute()

    async def record_agreement(self, model: str, version: str, score: float, now: float | None = None) -> None:
        await self._count(model, version, {"agree_sum": float(score), "agree_n": 1}, now)

    async def window(
        self, model: str, versions: list[str], window_s: float, now: float | None = None
    ) -> dict[str, WindowStats]:
        buckets = list(_buckets(window_s, now or time.time()))
        async with self._errors(f"read the outcomes of {model}"):
            pipe = self.redis.pipeline(transaction=False)
            for version in versions:
                for b in buckets:
                    pipe.hgetall(c.rollout_stats_key(model, version, b))
            rows = await pipe.execute()
        out = {}
        for i, version in enumerate(versions):
            summed: dict[str, float] = defaultdict(float)
            for row in rows[i * len(buckets) : (i + 1) * len(buckets)]:
                for field, n in row.items():
                    name = field.decode() if isinstance(field, bytes) else field
                    summed[name] += float(n)
            out[version] = summarize(summed)
        return out

    async def claim_comparison(self, model: str, job_id: str) -> bool:
        async with self._errors(f"claim the comparison of {job_id}"):
            done = await self.redis.set(c.rollout_compared_key(model, job_id), b"1", nx=True, ex=COMPARISON_TTL_S)
        return bool(done)

    async def tally(self, model: str, versions: list[str]) -> dict[str, Tally]:
        async with self._errors(f"read the tallies of {model}"):
            pipe = self.redis.pipeline(transaction=False)
            for version in versions:
                pipe.hgetall(c.rollout_tally_key(model, version))
            rows = await pipe.execute()
        return {v: _tally_of(row) for v, row in zip(versions, rows, strict=True)}

    async def acquire_lock(self, owner: str, ttl_s: float) -> bool:
        ttl_ms = max(1, int(ttl_s * 1000))
        async with self._errors("take the rollout controller's lock"):
            held = bool(await self.redis.set(c.ROLLOUT_LOCK_KEY, owner, nx=True, px=ttl_ms))
            if not held:
                held = bool(await self._renew(keys=[c.ROLLOUT_LOCK_KEY], args=[owner, ttl_ms]))
        return held

    async def release_lock(self, owner: str) -> None:
        async with self._errors("release the rollout controller's lock"):
            await self._release(keys=[c.ROLLOUT_LOCK_KEY], args=[owner])

    async def record_outcomes(self, outcomes: list[Outcome], now: float | None = None) -> None:
        if not outcomes:
            return
        at = now or time.time()
        bucket = int(at // STATS_BUCKET_S)
        async with self._errors(f"count {len(outcomes)} outcomes"):
            pipe = self.redis.pipeline(transaction=False)
            keys = set()
            for o in outcomes:
                key = c.rollout_stats_key(o.model, o.version, bucket)
                keys.add(key)
                for field, n in _stats_fields(o.ok, o.latency_ms).items():
                    pipe.hincrby(key, field, n)
                _count_tally(pipe, c.rollout_tally_key(o.model, o.version), o.ok, at)
            for key in keys:
                pipe.expire(key, STATS_TTL_S)
            await pipe.execute()

    async def add_comparison(self, entry: ComparisonEntry) -> None:
        key = c.rollout_comparisons_key(entry.model)
        async with self._errors(f"record a comparison of {entry.model}"):
            pipe = self.redis.pipeline(transaction=False)
            pipe.lpush(key, entry.model_dump_json())
            pipe.ltrim(key, 0, COMPARISONS_KEPT - 1)
            pipe.expire(key, STATS_TTL_S * 24)
            await pipe.execute()

    async def comparisons(self, model: str, limit: int = 50) -> list[ComparisonEntry]:
        if limit <= 0:
            return []
        async with self._errors(f"read the comparisons of {model}"):
            rows = await self.redis.lrange(c.rollout_comparisons_key(model), 0, limit - 1)
        return [ComparisonEntry.model_validate_json(raw) for raw in rows]
