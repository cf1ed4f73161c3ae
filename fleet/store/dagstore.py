"""Where DAG specs and runs live: next to the job records, in Redis (or in memory for ``fleet up``).

* Specs: ``register(name, spec)`` adds an immutable version (1, 2, ...) under ``fleet:dagspec:<name>``. The
  runner names a tenant's DAG ``<tenant>:<name>`` (``fleet.dags.state.scoped``; the default tenant's is the bare name),
  so each tenant has its own versions: ``fleet:dagspec:<tenant>:<name>``.
* Runs: one JSON document per run under ``fleet:dag:<run>`` (``RunDoc``: the run's state, the spec version it
  runs, its key, its tenant, its times; the runner's ``<run>`` is ``<tenant>:<run id>`` for a tenant other than
  the default, ``fleet.dags.runner.store_id``), created once (``create_run`` is idempotent on the run id) and changed
  only through ``update_run``: read, apply a pure function, write back with one atomic compare-and-set script that also
  publishes the new document on ``fleet:dagevents:<run>``. Two workers settling two items of one fan-out at once
  cannot both win: the loser reads again and re-applies its change, so a join fires exactly once.
* Recent runs: ``create_run`` also adds the run to a capped index (``fleet:dagruns:recent``, a sorted set by start
  time keeping the newest ``DEFAULT_RECENT_RUNS_KEPT``); ``recent_runs(limit)`` reads the newest documents that
  still exist, newest first (the operator dashboard's list).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from fleet import constants as c
from fleet.errors import StoreError
from fleet.store.redis_errors import RedisErrors, text

if TYPE_CHECKING:
    from fleet.store.redis import RedisStore

RunDoc = dict[str, Any]
"""``{"run": RunState.to_dict(), "version": int, "key"?: str, "tenant"?: str, "created_at": float,
"deadline": float | None, "finished_at": float | None,
"times": {<step>: {"started_at": float | None, "finished_at": float | None}}}`` (``key``: the secret part of the
run's job ids, ``fleet.dags.state.job_id``; absent in a run written before keys; ``tenant``: absent for the default)."""

MAX_CAS_ATTEMPTS = 64
KNOWN_RUNS = 10_000  # run documents a process remembers having written, to skip the read before an update


class DagStore(Protocol):
    async def register(self, name: str, spec: dict[str, Any]) -> int: ...

    async def spec(self, name: str, version: int | None = None) -> tuple[int, dict[str, Any]] | None: ...

    async def latest_version(self, name: str) -> int | None:
        """The newest version of ``name`` (None: no such DAG)."""
        ...

    async def names(self) -> list[str]: ...

    async def versions(self, name: str) -> list[int]: ...

    async def create_run(self, run_id: str, doc: RunDoc) -> tuple[bool, RunDoc]: ...

    async def get_run(self, run_id: str) -> RunDoc | None: ...

    async def update_run(self, run_id: str, change: Callable[[RunDoc], RunDoc | None]) -> tuple[RunDoc, RunDoc]:
        """``(before, after)`` of applying ``change`` (which returns a new document, or None for no change, and
        never alters the one it is given); re-applied on a conflict."""
        ...

    async def wait_change(self, run_id: str, seen: RunDoc | None, timeout_s: float) -> RunDoc | None: ...

    async def recent_runs(self, limit: int) -> list[tuple[str, RunDoc]]: ...


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=True)


class MemoryDagStore:
    """The in-memory DAG store of ``fleet up``: one per process, shared by its gateway and workers."""

    def __init__(self, *, job_ttl_s: int) -> None:
        self.job_ttl_s = job_ttl_s
        self._specs: dict[str, dict[int, dict[str, Any]]] = {}
        self._runs: dict[str, tuple[str, float]] = {}
        self._recent: deque[str] = deque(maxlen=c.DEFAULT_RECENT_RUNS_KEPT)
        self._changed = asyncio.Condition()

    async def register(self, name: str, spec: dict[str, Any]) -> int:
        versions = self._specs.setdefault(name, {})
        same = [v for v, s in versions.items() if s == spec]
        if same:
            return max(same)
        version = max(versions, default=0) + 1
        versions[version] = json.loads(_dumps(spec))
        return version

    async def spec(self, name: str, version: int | None = None) -> tuple[int, dict[str, Any]] | None:
        versions = self._specs.get(name)
        if not versions:
            return None
        chosen = max(versions) if version is None else version
        return (chosen, versions[chosen]) if chosen in versions else None

    async def latest_version(self, name: str) -> int | None:
        return max(self._specs.get(name) or [0]) or None

    async def names(self) -> list[str]:
        return sorted(self._specs)

    async def versions(self, name: str) -> list[int]:
        return sorted(self._specs.get(name, {}))

    async def create_run(self, run_id: str, doc: RunDoc) -> tuple[bool, RunDoc]:
        current = self._read(run_id)
        if current is not None:
            return False, current
        await self._write(run_id, _dumps(doc))
        self._recent.append(run_id)
        return True, json.loads(_dumps(doc))

    async def recent_runs(self, limit: int) -> list[tuple[str, RunDoc]]:
        out = []
        for run_id in reversed(self._recent):
            doc = self._read(run_id)
            if doc is not None:
                out.append((run_id, doc))
            if len(out) >= limit:
                break
        return out

    async def get_run(self, run_id: str) -> RunDoc | None:
        return self._read(run_id)

    async def update_run(self, run_id: str, change: Callable[[RunDoc], RunDoc | None]) -> tuple[RunDoc, RunDoc]:
        current = self._read(run_id)
        if current is None:
            raise StoreError(f"no DAG run {run_id!r} (it may have expired)")
        new = change(current)  # a change builds a new document; it never alters the one it is given
        if new is None:
            return current, current
        raw = _dumps(new)
        await self._write(run_id, raw)
        return current, json.loads(raw)

    async def wait_change(self, run_id: str, seen: RunDoc | None, timeout_s: float) -> RunDoc | None:
        async with self._changed:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._changed.wait_for(lambda: self._read(run_id) != seen)
            except TimeoutError:
                pass
        return self._read(run_id)

    def _read(self, run_id: str) -> RunDoc | None:
        entry = self._runs.get(run_id)
        if entry is None or entry[1] < time.monotonic():
            self._runs.pop(run_id, None)
            return None
        result: RunDoc = json.loads(entry[0])
        return result

    async def _write(self, run_id: str, raw: str) -> None:
        self._runs[run_id] = (raw, time.monotonic() + self.job_ttl_s)
        async with self._changed:
            self._changed.notify_all()


class RedisDagStore:
    """The DAG store in the Redis of ``store`` (a ``RedisStore``): its client, TTL and pub/sub connection."""

    def __init__(self, store: RedisStore) -> None:
        self._store = store
        self.redis = store.redis
        self.job_ttl_s: int = store.job_ttl_s
        self._cas = self.redis.register_script(REDIS_CAS_LUA)
        self._register = self.redis.register_script(REGISTER_LUA)
        self._create = self.redis.register_script(CREATE_RUN_LUA)
        self._known: OrderedDict[str, bytes | str] = OrderedDict()  # run id -> the document this process wrote last

    def _remember(self, run_id: str, raw: str) -> None:
        self._known[run_id] = raw
        self._known.move_to_end(run_id)
        if len(self._known) > KNOWN_RUNS:
            self._known.popitem(last=False)

    async def register(self, name: str, spec: dict[str, Any]) -> int:
        raw = _dumps(spec)
        key = c.dag_spec_key(name)
        async with self._errors("register a DAG"):
            version = await self._register(keys=[key, c.DAG_SPECS_KEY], args=[name, raw])
        return int(version)

    async def spec(self, name: str, version: int | None = None) -> tuple[int, dict[str, Any]] | None:
        key = c.dag_spec_key(name)
        async with self._errors(f"read DAG {name!r}"):
            chosen = version if version is not None else await self.redis.hget(key, "latest")
            if chosen is None:
                return None
            raw = await self.redis.hget(key, str(int(chosen)))
        return None if raw is None else (int(chosen), json.loads(raw))

    async def latest_version(self, name: str) -> int | None:
        async with self._errors(f"read DAG {name!r}"):
            latest = await self.redis.hget(c.dag_spec_key(name), "latest")
        return None if latest is None else int(latest)

    async def names(self) -> list[str]:
        async with self._errors("list DAGs"):
            names = await self.redis.smembers(c.DAG_SPECS_KEY)
        return sorted(n.decode() if isinstance(n, bytes) else n for n in names)

    async def versions(self, name: str) -> list[int]:
        async with self._errors(f"read DAG {name!r}"):
            fields = await self.redis.hkeys(c.dag_spec_key(name))
        return sorted(int(f) for f in (x.decode() if isinstance(x, bytes) else x for x in fields) if f.isdigit())

    async def create_run(self, run_id: str, doc: RunDoc) -> tuple[bool, RunDoc]:
        """One script: the document when the run is new (then also indexed as recent), else the one stored."""
        raw = _dumps(doc)
        args = [raw, self.job_ttl_s, run_id, time.time(), c.DEFAULT_RECENT_RUNS_KEPT]
        async with self._errors(f"create DAG run {run_id!r}"):
            existing = await self._create(keys=[c.dag_key(run_id), c.DAG_RECENT_RUNS_KEY], args=args)
        if not existing:
            self._remember(run_id, raw)
            return True, json.loads(raw)
        return False, json.loads(existing)

    async def recent_runs(self, limit: int) -> list[tuple[str, RunDoc]]:
        async with self._errors("read the recent DAG runs"):
            ids = [text(i) for i in await self.redis.zrevrange(c.DAG_RECENT_RUNS_KEY, 0, max(0, limit - 1))]
            raws = await self.redis.mget([c.dag_key(i) for i in ids]) if ids else []
        return [(run_id, json.loads(raw)) for run_id, raw in zip(ids, raws, strict=True) if raw is not None]

    async def get_run(self, run_id: str) -> RunDoc | None:
        async with self._errors(f"read DAG run {run_id!r}"):
            raw = await self.redis.get(c.dag_key(run_id))
        return None if raw is None else json.loads(raw)

    async def update_run(self, run_id: str, change: Callable[[RunDoc], RunDoc | None]) -> tuple[RunDoc, RunDoc]:
        key = c.dag_key(run_id)
        raw = self._known.get(run_id)  # what this process wrote last: a stale guess only costs a retry
        guessed = raw is not None
        if raw is None:
            async with self._errors(f"read DAG run {run_id!r}"):
                raw = await self.redis.get(key)
        for _ in range(MAX_CAS_ATTEMPTS):
            if raw is None:
                raise StoreError(f"no DAG run {run_id!r} (it may have expired)")
            current = json.loads(raw)
            new = change(current)  # a change builds a new document; it never alters the one it is given
            if new is None and guessed:  # "nothing to change" must be said of the stored document, not a guess
                guessed = False
                async with self._errors(f"read DAG run {run_id!r}"):
                    raw = await self.redis.get(key)
                continue
            if new is None:
                return current, current
            new_raw = _dumps(new)
            async with self._errors(f"update DAG run {run_id!r}"):
                result = await self._cas(keys=[key], args=[raw, new_raw, self.job_ttl_s, c.dag_events_channel(run_id)])
            if int(result[0]) == 1:
                self._remember(run_id, new_raw)
                return current, new
            raw = result[1] or None
            guessed = False
            self._known.pop(run_id, None)
        raise StoreError(f"DAG run {run_id!r} changed {MAX_CAS_ATTEMPTS} times while it was being updated")

    async def wait_change(self, run_id: str, seen: RunDoc | None, timeout_s: float) -> RunDoc | None:
        mux = self._store.pubsub
        channel = c.dag_events_channel(run_id)
        future = await mux.watch(channel, timeout_s)
        try:
            last = mux.last_message(channel)  # the document it woke a waiter with, when nothing came since
            current: RunDoc | None
            if seen is not None and last is not None and json.loads(last) == seen:
                current = seen
            else:
                current = await self.get_run(run_id)
            if current != seen:
                return current
            try:
                async with asyncio.timeout(timeout_s):
                    published = await future
            except TimeoutError:
                published = None
        finally:
            mux.release(channel, future)
        if published:  # the update script publishes the document it wrote: no read needed
            changed: RunDoc = json.loads(published)
            return changed
        return await self.get_run(run_id)  # timed out, or woken by a reconnection: read what is there

    def _errors(self, action: str) -> Any:
        return RedisErrors("DAG store", self._store.display_url, action)


# KEYS[1] run key; ARGV: expected value, new value, ttl_s, channel. {1} when written, else {0, current or ''}.
REDIS_CAS_LUA = """
local current = redis.call('GET', KEYS[1])
if not current then current = '' end
if current ~= ARGV[1] then return {0, current} end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
redis.call('PUBLISH', ARGV[4], ARGV[2])
return {1}
"""

# KEYS: run key, recent runs; ARGV: document, ttl_s, run id, unix time, runs kept. The stored document when there is
# one (the run exists), else '' after writing this one and indexing the run (the newest ``kept`` stay indexed).
CREATE_RUN_LUA = """
local current = redis.call('GET', KEYS[1])
if current then return current end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[3])
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -(tonumber(ARGV[5]) + 1))
return ''
"""

# KEYS: spec hash, names set; ARGV: name, spec JSON. A spec equal to a registered version returns that version.
REGISTER_LUA = """
local fields = redis.call('HGETALL', KEYS[1])
local best = 0
for i = 1, #fields, 2 do
  local n = tonumber(fields[i])
  if n and fields[i + 1] == ARGV[2] and n > best then best = n end
end
if best > 0 then return best end
local version = redis.call('HINCRBY', KEYS[1], 'latest', 1)
redis.call('HSET', KEYS[1], tostring(version), ARGV[2])
redis.call('SADD', KEYS[2], ARGV[1])
return version
"""
