"""The Redis result store.

Each job is one string key, ``fleet:job:<id>`` (``fleet.constants.job_key``), holding the record's JSON
(``transitions.record_json``: ``JobRecord.model_dump_json()`` less its null fields, by orjson) with a TTL of
``job_ttl_s`` refreshed by every write. Transitions are computed in Python (``fleet.store.transitions``) and written
by one Lua script, a compare-and-set on the whole stored value: the write happens only when the key still holds what
the caller read, so nothing written in between is lost and no JSON is decoded or re-encoded inside Redis. The same
holds for the ownership check of ``start_many`` / ``finish_many`` (``transitions.foreign``): it is made on the value
the script compares against, so a record that changes hands in between fails the compare and is checked again.
``finish`` publishes the terminal record on ``fleet.constants.done_channel(job_id)`` in the same script, and
``wait`` listens there through one pub/sub connection shared by all waiters (``fleet.store.pubsub``).

Unpublished jobs (``create`` with a message): the sorted set ``fleet.constants.PENDING_KEY`` of job ids scored by
Redis's clock, and each message under ``pending_message_key(job_id)`` with the record's TTL. Creating the record
and marking it is one script; ``published`` is one pipelined round trip.

On a Redis Cluster (``redis+cluster://``) the same store shards: see ``fleet.store.cluster`` for what changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar, cast

from redis import asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fleet import constants as c
from fleet.errors import StoreError
from fleet.links import link_error
from fleet.redaction import redact
from fleet.schemas.jobs import TERMINAL_STATES, JobError, JobRecord, JobState
from fleet.store import cluster as cl
from fleet.store import transitions
from fleet.store.base import Finish, Start
from fleet.store.jobindex import (
    INDEX_FN,
    INDEX_MANY_LUA,
    READ_CHUNK,
    Position,
    Refreshes,
    Scope,
    after,
    bounds,
    hash_tag,
    index_keys,
    index_many_args,
    score_arg,
)
from fleet.store.packed import parse_record
from fleet.store.pubsub import PubSubMux
from fleet.store.recheck import RECHECK_INTERVAL_S, Rechecker
from fleet.store.redis_packing import with_hiredis_packing

log = logging.getLogger(__name__)
_Item = TypeVar("_Item", Start, Finish)

# KEYS[1] job key; ARGV: expected value ('' = absent), new value, ttl_s, channel to publish on ('' = none).
# Returns {1} when written, {0, current} (current '' when absent) when the key no longer holds the expected value.
CAS_LUA = """
local current = redis.call('GET', KEYS[1])
if not current then current = '' end
if current ~= ARGV[1] then return {0, current} end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
if ARGV[4] ~= '' then redis.call('PUBLISH', ARGV[4], ARGV[2]) end
return {1}
"""

# The same compare-and-set for a whole micro-batch in one command. KEYS: job keys. ARGV: ttl_s, publish ('1' or
# '0'), key prefix length, channel prefix, the byte lengths "n1,n2,..." of each key's expected value ('' = absent:
# a record is never empty), those expected values concatenated, then one new value per key. The expected values are
# the small records a worker itself wrote or read (queued, running), never outputs, so packing them keeps the
# client's per-argument cost low; the new values (outputs, often kilobytes) are arguments of their own because
# cutting them out of one large string costs Redis, the one server every worker shares, more than the client
# saves. Comparing whole values (like CAS_LUA) needs no digest on either side. Returns per key 1 when written, else
# the current value ('' when absent). The completion channel of a key is the channel prefix plus the job id. A key
# expected absent (a job published straight to the broker: its first start) costs one SET NX, not a GET and a SET.
CAS_MANY_LUA = """
local out = {}
local cut = tonumber(ARGV[3]) + 1
local blob = ARGV[6]
local from, i = 1, 0
for expected_len in string.gmatch(ARGV[5], '%d+') do
  i = i + 1
  local upto = from + tonumber(expected_len)
  local value = ARGV[6 + i]
  local written = false
  local current
  if upto == from then  -- expected absent: one SET NX, no read
    written = redis.call('SET', KEYS[i], value, 'NX', 'EX', ARGV[1])
    if not written then current = redis.call('GET', KEYS[i]) or '' end
  else
    current = redis.call('GET', KEYS[i]) or ''
    if current == string.sub(blob, from, upto - 1) then
      redis.call('SET', KEYS[i], value, 'EX', ARGV[1])
      written = true
    end
  end
  if written then
    if ARGV[2] == '1' then redis.call('PUBLISH', ARGV[4] .. string.sub(KEYS[i], cut), value) end
    out[i] = 1
  else
    out[i] = current
  end
  from = upto
end
return out
"""
# KEYS: job key, pending set, message key, the job's four index keys (``jobindex.index_keys``); ARGV: record, ttl_s,
# job id, message, created_at, index cutoff. The record only when absent, and then the job marked unpublished, scored
# by Redis's own clock (the same for every gateway), and indexed (``fleet.store.jobindex``). Returns 1 if created.
CREATE_PENDING_LUA = (
    INDEX_FN
    + """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then return 0 end
local t = redis.call('TIME')
redis.call('SET', KEYS[3], ARGV[4], 'EX', ARGV[2])
redis.call('ZADD', KEYS[2], tonumber(t[1]) + tonumber(t[2]) / 1000000, ARGV[3])
fleet_index(4, ARGV[5], ARGV[3], ARGV[6], ARGV[2])
return 1
"""
)
# KEYS[1] job key; ARGV: record, ttl_s, completion channel. A terminal record only when absent, announced to the job's
# waiters as a finish is. Returns 1 if created. (On a cluster; on one Redis ``CREATE_TERMINAL_INDEXED_LUA``.)
CREATE_TERMINAL_LUA = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then return 0 end
redis.call('PUBLISH', ARGV[3], ARGV[1])
return 1
"""
# CREATE_TERMINAL_LUA with the job's four index keys after its key and ARGV job id, created_at, index cutoff after its
# own: the record and its index entries in one script (one Redis).
CREATE_TERMINAL_INDEXED_LUA = (
    INDEX_FN
    + """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then return 0 end
redis.call('PUBLISH', ARGV[3], ARGV[1])
fleet_index(2, ARGV[5], ARGV[4], ARGV[6], ARGV[2])
return 1
"""
)
# KEYS: job key, its four index keys; ARGV: record, ttl_s, job id, created_at, index cutoff. A record with no message
# (one Redis). Returns 1 if created.
CREATE_INDEXED_LUA = (
    INDEX_FN
    + """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then return 0 end
fleet_index(2, ARGV[4], ARGV[3], ARGV[5], ARGV[2])
return 1
"""
)
# KEYS: pending set, message key (one slot on a cluster); ARGV: job id, message, ttl_s. The mark alone, scored by
# Redis's clock, unless the job is marked already. Returns 1 if it added the mark.
MARK_PENDING_LUA = """
local t = redis.call('TIME')
if redis.call('ZADD', KEYS[1], 'NX', tonumber(t[1]) + tonumber(t[2]) / 1000000, ARGV[1]) == 0 then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
return 1
"""
# KEYS[1] pending set; ARGV: older_than_s, limit, message key prefix. Returns id1, message1, id2, ... of the jobs
# marked longer ago than older_than_s, each re-scored to now so that no other sweep claims it meanwhile.
CLAIM_PENDING_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[1]), 'LIMIT', 0, tonumber(ARGV[2]))
local out = {}
for _, id in ipairs(ids) do
  redis.call('ZADD', KEYS[1], now, id)
  out[#out + 1] = id
  out[#out + 1] = redis.call('GET', ARGV[3] .. id) or ''
end
return out
"""
KNOWN_RECORDS = 65_536  # records this store wrote last, by job id: a batch finish then needs no read first
MAX_CAS_ATTEMPTS = 50  # each conflict means another writer made progress; this many in a row is a bug or a storm
HINT = "is redis-server running and reachable?"
REDIS_AUTH_SETTINGS = "FLEET_REDIS_USER and FLEET_REDIS_PASSWORD_FILE (and the user's ACL)"
WAIT_BACKOFF_S = (0.05, 2.0)  # first and longest pause of a waiter between reads that failed
ABSENT = b""  # the expected value of a key that does not exist (a record is never empty)
UNKNOWN: tuple[bytes, JobRecord | None] = (b"", None)  # not remembered: read it first (compared by identity)
JOB_KEY_PREFIX = c.job_key("").encode()  # job_key(id) is this prefix + id (the script cuts it off again)


class RedisStore:
    """``ResultStore`` on Redis. Construct, ``await connect()``, use, ``await close()``.

    Args:
        url: ``redis://[user:password@]host:port/db`` or ``rediss://...``; query options such as
            ``socket_timeout`` override the defaults below. ``redis+cluster://host:port[,host:port...]`` (or
            ``rediss+cluster://``) names seed nodes of a Redis Cluster (``fleet.store.cluster``).
        job_ttl_s: lifetime of a record after its last write.
        client: an already-built ``redis.asyncio.Redis`` to use instead of one built from ``url`` (not closed by
            ``close``).
        socket_timeout_s, connect_timeout_s: bounds on one command and on opening a connection, so an outage
            surfaces as ``StoreError`` instead of a hang.
        max_connections: size of the command connection pool; more concurrent commands wait (up to
            ``socket_timeout_s``) for a free connection. ``wait`` adds one pub/sub connection outside the pool.
        recheck_interval_s: how often the records of all waiters are re-read in batches, so a waiter whose
            completion notice was lost still gets its terminal record (``fleet.store.recheck``).
        link_options: redis-py keywords for the ACL user and TLS (``fleet.links.redis_options``); they win over
            the URL's.

    The client is available as ``redis`` for components that keep their own state in the same Redis.
    """

    scheme = "redis"

    def __init__(
        self,
        url: str,
        *,
        job_ttl_s: int,
        client: aioredis.Redis | RedisCluster | None = None,
        socket_timeout_s: float = 5.0,
        connect_timeout_s: float = 3.0,
        max_connections: int = 64,
        recheck_interval_s: float = RECHECK_INTERVAL_S,
        link_options: dict[str, Any] | None = None,
    ) -> None:
        if job_ttl_s < 1:
            raise ValueError(f"job_ttl_s must be at least 1, got {job_ttl_s}")
        self.url = url
        self.display_url = redact(url)
        self.job_ttl_s = job_ttl_s
        self._connect_timeout_s = connect_timeout_s
        self._owns_client = client is None
        self.cluster_mode = cl.is_cluster_url(url) if client is None else isinstance(client, RedisCluster)
        if client is None:
            build = cl.cluster_client if self.cluster_mode else _client
            client = build(url, socket_timeout_s, connect_timeout_s, max_connections, link_options or {})
        assert client is not None
        self.redis: Any = cast(Any, client)  # aioredis.Redis, or RedisCluster in cluster mode
        self._pending_key = cl.PENDING_KEY_CLUSTER if self.cluster_mode else c.PENDING_KEY
        self._message_key = cl.pending_message_key_cluster if self.cluster_mode else c.pending_message_key
        self._done_channel = cl.done_channel_cluster if self.cluster_mode else c.done_channel
        self._cas_lua = cl.sharded(CAS_LUA) if self.cluster_mode else CAS_LUA
        self._cas = self.redis.register_script(self._cas_lua)
        self._cas_many_lua = cl.CROSS_SLOT + cl.sharded(CAS_MANY_LUA) if self.cluster_mode else CAS_MANY_LUA
        self._cas_many_script = self.redis.register_script(self._cas_many_lua)
        self._create_pending = self.redis.register_script(CREATE_PENDING_LUA)
        self._mark_pending = self.redis.register_script(MARK_PENDING_LUA)
        self._claim_pending = self.redis.register_script(CLAIM_PENDING_LUA)
        self._create_terminal_lua = (
            cl.sharded(CREATE_TERMINAL_LUA) if self.cluster_mode else CREATE_TERMINAL_INDEXED_LUA
        )
        self._create_terminal = self.redis.register_script(self._create_terminal_lua)
        self._create_indexed = self.redis.register_script(CREATE_INDEXED_LUA)
        self._index_many = self.redis.register_script(INDEX_MANY_LUA)
        self._known: OrderedDict[str, tuple[bytes, JobRecord | None]] = OrderedDict()
        self._refreshes = Refreshes(job_ttl_s)
        self._mux: Any
        if self.cluster_mode:
            self._mux = cl.ShardedMux(self.redis, display_url=self.display_url)
            job_of = cl.job_of_channel_cluster
        else:
            self._mux = PubSubMux(self.redis.connection_pool, display_url=self.display_url)
            job_of = _job_of_channel
        self._recheck = Rechecker(self.redis, self._mux, interval_s=recheck_interval_s, job_of_channel=job_of)
        self._closed = False

    @property
    def pubsub(self) -> PubSubMux:
        """The shared pub/sub connection behind ``wait`` (exposed for metrics and tests)."""
        return self._mux

    async def connect(self) -> None:
        """Check that Redis answers; raise ``StoreError`` naming the URL within a few seconds when it does not."""
        try:
            async with asyncio.timeout(self._connect_timeout_s + 1):
                if self.cluster_mode:
                    await self.redis.initialize()
                await self.redis.ping()
            scripts = (
                self._cas_lua,
                self._cas_many_lua,
                self._create_terminal_lua,
                MARK_PENDING_LUA,
                CLAIM_PENDING_LUA,
                INDEX_MANY_LUA,
            )
            for script in (*scripts, *(() if self.cluster_mode else (CREATE_PENDING_LUA, CREATE_INDEXED_LUA))):
                await self.redis.script_load(script)
        except (RedisError, RedisClusterException, OSError) as exc:
            refused = link_error("Redis", self.display_url, exc, REDIS_AUTH_SETTINGS)
            if refused is not None:
                raise refused from None
            raise StoreError(f"cannot reach the result store at {self.display_url} ({exc}); {HINT}") from exc
        log.debug("result store connected: %s", self.display_url)

    async def close(self) -> None:
        """Idempotent. Waiters still blocked in ``wait`` raise ``StoreError``."""
        if self._closed:
            return
        self._closed = True
        await self._recheck.close()
        await self._mux.close()
        if self._owns_client:
            await self.redis.aclose()

    async def ping(self) -> None:
        with self._errors("answer PING"):
            await self.redis.ping()

    async def create(self, record: JobRecord, message: bytes | None = None) -> bool:
        raw, job_id = transitions.record_json(record), record.job_id
        with self._errors(f"create job {job_id!r}"):
            if self.cluster_mode:
                created = await self._create_cluster(record, raw, message)
                if created:
                    await self.index([record])
                return created
            if message is not None and record.state not in TERMINAL_STATES:
                keys, args = self.pending_create(record, message, raw)
                return bool(await self._create_pending(keys=keys, args=args))
            index = index_keys(record)
            keys = [c.job_key(job_id), *index]
            indexing = [score_arg(record.created_at), self._index_cutoff(index)]
            if record.state in TERMINAL_STATES:  # an answer known at once (a cache hit): announced like a finish
                args = [raw, self.job_ttl_s, self._done_channel(job_id), job_id, *indexing]
                return bool(await self._create_terminal(keys=keys, args=args))
            return bool(await self._create_indexed(keys=keys, args=[raw, self.job_ttl_s, job_id, *indexing]))

    async def _create_cluster(self, record: JobRecord, raw: bytes, message: bytes | None) -> bool:
        job_id = record.job_id
        if record.state in TERMINAL_STATES:
            args: list[bytes | str | int] = [raw, self.job_ttl_s, self._done_channel(job_id)]
            return bool(await self._create_terminal(keys=[c.job_key(job_id)], args=args))
        if message is None:
            return bool(await self.redis.set(c.job_key(job_id), raw, nx=True, ex=self.job_ttl_s))
        return await self._create_marked_cluster(job_id, raw, message)

    def _index_cutoff(self, keys: list[str]) -> str:
        """The trim cutoff the create scripts pass for ``keys``: '' (add only) unless this store last trimmed and
        re-armed one of them more than ``jobindex.REFRESH_SHARE`` of the TTL ago (``jobindex.Refreshes``)."""
        now = time.time()
        return score_arg(now - self.job_ttl_s) if self._refreshes.due(keys, now) else ""

    def pending_create(
        self, record: JobRecord, message: bytes, raw: bytes | None = None
    ) -> tuple[list[str], list[bytes | str | int]]:
        """The KEYS and ARGV of ``CREATE_PENDING_LUA`` for ``create(record, message)`` on one Redis (also run, inside
        ``fleet.store.quotas.ADMIT_CREATE_LUA``, by a gateway's limits)."""
        job_id = record.job_id
        index = index_keys(record)
        keys = [c.job_key(job_id), c.PENDING_KEY, c.pending_message_key(job_id), *index]
        raw = raw if raw is not None else transitions.record_json(record)
        return keys, [raw, self.job_ttl_s, job_id, message, score_arg(record.created_at), self._index_cutoff(index)]

    # -- the job index (fleet.store.jobindex) --------------------------------------------------------------------
    async def index(self, records: list[JobRecord]) -> None:
        """Add the entries of records this store created outside a create script (a worker's start or finish of a
        job that had none, a create on a cluster): one command, on a cluster one per hash tag, concurrently. Never
        raises: the records are written, and a failure here only leaves them out of listings (logged)."""
        if not records:
            return
        try:
            with self._errors(f"index {len(records)} jobs"):
                if not self.cluster_mode:
                    keys, args = index_many_args(records, self.job_ttl_s, time.time())
                    await self._index_many(keys=keys, args=args)
                    return
                groups: dict[str, list[JobRecord]] = {}
                for record in records:
                    for key in index_keys(record)[::2]:  # one key of each tag: (tenant, all)
                        groups.setdefault(hash_tag(key), []).append(record)
                await asyncio.gather(*(self._index_tag(tag, group) for tag, group in groups.items()))
        except StoreError as exc:  # the records are written: a listing misses them, nothing else does
            log.warning("%d new jobs were not added to the job index: %s", len(records), exc.message)

    async def _index_tag(self, tag: str, records: list[JobRecord]) -> None:
        keys, args = index_many_args(records, self.job_ttl_s, time.time())
        mine = [i + 1 for i, key in enumerate(keys) if hash_tag(key) == tag]
        renumber = {old: new for new, old in enumerate(mine, start=1)}
        part: list[Any] = args[:2]
        for i in range(2, len(args), 3):
            if args[i] in renumber:
                part += [renumber[args[i]], args[i + 1], args[i + 2]]
        await self._index_many(keys=[keys[i - 1] for i in mine], args=part)

    async def index_page(
        self, scope: Scope, since: float | None, until: float | None, position: Position | None, count: int
    ) -> list[Position]:
        """Up to ``count`` entries of ``scope``'s index after ``position`` (None: from the newest), newest first,
        created between ``since`` and ``until`` (inclusive; None: unbounded)."""
        high, low = bounds(since, until, position)
        if high < low or count <= 0:
            return []
        key, offset, skipping = scope.key, 0, position is not None
        out: list[Position] = []
        with self._errors("read the job index"):
            while True:
                chunk = min(count - len(out) + 8, READ_CHUNK)
                raw = await self.redis.zrevrangebyscore(key, high, low, start=offset, num=chunk, withscores=True)
                entries = [Position(float(score), _as_bytes(m).decode()) for m, score in raw]
                kept = after(entries, position) if skipping else entries
                skipping = skipping and not kept  # the entries at or before the position are a prefix
                out += kept[: count - len(out)]
                if len(out) >= count or len(entries) < chunk:
                    return out
                offset += len(entries)

    async def index_forget(self, scope: Scope, entries: list[Position]) -> None:
        """Remove entries of ``scope``'s index whose records are gone."""
        if entries:
            with self._errors("trim the job index"):
                await self.redis.zrem(scope.key, *[e.job_id for e in entries])

    async def _create_marked_cluster(self, job_id: str, raw: bytes, message: bytes) -> bool:
        """``create(record, message)`` on a cluster, where the record and the marks are in different slots: the mark
        first (a gateway dying next leaves a mark without a record, which the reconcile sweep clears), then the
        record; a mark this call added for a job that existed already is taken back."""
        keys = [self._pending_key, self._message_key(job_id)]
        marked = await self._mark_pending(keys=keys, args=[job_id, message, self.job_ttl_s])
        if await self.redis.set(c.job_key(job_id), raw, nx=True, ex=self.job_ttl_s):
            return True
        if marked:
            await self._unmark(job_id)
        return False

    async def _unmark(self, job_id: str) -> None:
        if self.cluster_mode:  # plain commands: a cluster pipeline would bypass the client's bound on connections
            await self.redis.execute_command("ZREM", self._pending_key, job_id)
            await self.redis.delete(self._message_key(job_id))
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(self._pending_key, job_id)
            pipe.delete(self._message_key(job_id))
            await pipe.execute()

    async def published(self, job_id: str) -> None:
        with self._errors(f"mark job {job_id!r} published"):
            await self._unmark(job_id)

    async def claim_unpublished(self, older_than_s: float, limit: int) -> list[tuple[str, bytes | None]]:
        args: list[float | int | str] = [older_than_s, limit, self._message_key("")]
        with self._errors("claim unpublished jobs"):
            flat = await self._claim_pending(keys=[self._pending_key], args=args)
        pairs = zip(flat[::2], flat[1::2], strict=True)
        return [(_as_bytes(job_id).decode(), _as_bytes(message) or None) for job_id, message in pairs]

    async def get(self, job_id: str) -> JobRecord | None:
        with self._errors(f"read job {job_id!r}"):
            raw = await self.redis.get(c.job_key(job_id))
        return None if raw is None else self._parse(job_id, raw)

    async def get_many(self, job_ids: list[str]) -> list[JobRecord | None]:
        """One MGET. What it reads is remembered, so the ``start_many`` that usually follows needs no read."""
        if not job_ids:
            return []
        keys = [JOB_KEY_PREFIX + job_id.encode() for job_id in job_ids]
        with self._errors(f"read {len(job_ids)} jobs"):
            raws = await self._mget(keys)
        records: list[JobRecord | None] = []
        known = self._known
        for job_id, raw in zip(job_ids, raws, strict=True):
            data, record = self._state_of(job_id, raw)
            if record is not None:
                self._remember(job_id, data, record)
            else:  # absent (published straight to the broker, a DAG step): the start writes without a read
                known[job_id] = (ABSENT, None)
                known.move_to_end(job_id)
                if len(known) > KNOWN_RECORDS:
                    known.popitem(last=False)
            records.append(record)
        return records

    async def delete(self, job_id: str) -> None:
        with self._errors(f"delete job {job_id!r}"):
            if self.cluster_mode:
                await asyncio.gather(self.redis.delete(c.job_key(job_id)), self._unmark(job_id))
                return
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.delete(c.job_key(job_id), c.pending_message_key(job_id))
                pipe.zrem(c.PENDING_KEY, job_id)
                await pipe.execute()

    async def start(self, job_id: str, *, model: str, worker_id: str, deliveries: int) -> JobRecord:
        raw = await self._get_raw(job_id)
        for _ in range(MAX_CAS_ATTEMPTS):
            current = None if raw is None else self._parse(job_id, raw)
            if current is not None and current.terminal:
                return current
            record = transitions.started(
                current, job_id, model=model, worker_id=worker_id, deliveries=deliveries, now=time.time()
            )
            written, raw = await self._compare_and_set(job_id, raw, transitions.record_json(record), publish=False)
            if written:
                if current is None:  # it had no record: this one is born here
                    await self.index([record])
                return record
        raise self._contention(job_id)

    async def finish(
        self,
        job_id: str,
        state: JobState,
        *,
        model: str,
        output: Any = None,
        error: JobError | None = None,
        worker_id: str | None = None,
    ) -> tuple[bool, JobRecord]:
        raw = await self._get_raw(job_id)
        for _ in range(MAX_CAS_ATTEMPTS):
            current = None if raw is None else self._parse(job_id, raw)
            if current is not None and current.terminal:
                return False, current
            record = transitions.finished(
                current, job_id, state, model=model, output=output, error=error, worker_id=worker_id, now=time.time()
            )
            written, raw = await self._compare_and_set(job_id, raw, transitions.record_json(record), publish=True)
            if written:
                if current is None:
                    await self.index([record])
                return True, record
        raise self._contention(job_id)

    async def start_many(self, items: list[Start]) -> list[JobRecord]:
        """``start`` for a batch: one MGET and one pipelined compare-and-set per round, whatever the batch size. A
        record of another model or tenant (``transitions.foreign``) is handed back unchanged, as a terminal one is."""
        now = time.time()
        started, foreign = transitions.started, transitions.foreign

        def step(it: Start, current: JobRecord | None) -> JobRecord | None:
            if current is not None and (current.state in TERMINAL_STATES or foreign(current, it.model, it.tenant)):
                return None
            deliveries = it.deliveries
            if it.unread and current is not None:  # it had a record after all: count on from its runs
                deliveries = max(deliveries, current.deliveries + 1)
            return started(
                current,
                it.job_id,
                model=it.model,
                worker_id=it.worker_id,
                deliveries=deliveries,
                now=now,
                tenant=it.tenant,
                batch_size=it.batch_size,
                strikes=it.strikes,
                version=it.version,
            )

        unread = {it.job_id for it in items if it.unread}
        results = await self._cas_many(items, step, publish=False, assume_absent=unread)
        return [record for _, record in results]

    async def finish_many(self, items: list[Finish]) -> list[tuple[bool, JobRecord]]:
        """``finish`` for a batch, in a few round trips; each item wins or loses its own compare-and-set. A record of
        another model or tenant (``transitions.foreign``) loses: ``(False, that record)``, nothing written."""
        now = time.time()
        finished, foreign = transitions.finished, transitions.foreign

        def step(it: Finish, current: JobRecord | None) -> JobRecord | None:
            if current is not None and (current.state in TERMINAL_STATES or foreign(current, it.model, it.tenant)):
                return None
            return finished(
                current,
                it.job_id,
                it.state,
                model=it.model,
                output=it.output,
                error=it.error,
                worker_id=it.worker_id,
                now=now,
                tenant=it.tenant,
                version=it.version,
                device_seconds=it.device_seconds,
                timings=it.timings,
                trace_id=it.trace_id,
            )

        return await self._cas_many(items, step, publish=True)

    async def _cas_many(
        self,
        items: Sequence[_Item],
        next_record: Callable[[_Item, JobRecord | None], JobRecord | None],
        *,
        publish: bool,
        assume_absent: set[str] | frozenset[str] = frozenset(),
    ) -> list[tuple[bool, JobRecord]]:
        """Apply ``next_record`` (None: leave as is) to each job with compare-and-set, retrying lost races.

        The current records come from what this store last wrote (``_known``), else are guessed absent for the jobs
        in ``assume_absent``, else one MGET; a wrong guess only costs a retry, because the script compares with what
        Redis really holds.
        """
        if not items:
            return []
        job_ids = [it.job_id for it in items]
        keys = [JOB_KEY_PREFIX + job_id.encode() for job_id in job_ids]  # bytes: the client encodes them faster
        state = await self._current(job_ids, keys, assume_absent)
        results: list[tuple[bool, JobRecord] | None] = [None] * len(keys)
        pending: Iterable[int] = range(len(keys))
        for _ in range(MAX_CAS_ATTEMPTS):
            writes: list[tuple[int, JobRecord]] = []
            for i in pending:
                current = state[i][1]
                record = next_record(items[i], current)
                if record is None:
                    assert current is not None
                    results[i] = (False, current)
                else:
                    writes.append((i, record))
            pending = await self._write_many(job_ids, keys, state, writes, results, publish)
            if not pending:
                return results  # type: ignore[return-value]  # every item has its result now
        raise self._contention(job_ids[next(iter(pending))])

    async def _current(
        self, job_ids: list[str], keys: list[bytes], assume_absent: set[str] | frozenset[str] = frozenset()
    ) -> list[tuple[bytes, JobRecord | None]]:
        """(stored value, record) per job: remembered when this store wrote it last, else guessed absent (the jobs
        in ``assume_absent``), else read with one MGET."""
        known = self._known
        state: list[tuple[bytes, JobRecord | None]] = [
            known.get(job_id, (ABSENT, None) if job_id in assume_absent else UNKNOWN) for job_id in job_ids
        ]
        unknown = [i for i, entry in enumerate(state) if entry is UNKNOWN]
        if unknown:
            with self._errors(f"read {len(unknown)} jobs"):
                raws = await self._mget([keys[i] for i in unknown])
            for i, raw in zip(unknown, raws, strict=True):
                state[i] = self._state_of(job_ids[i], raw)
        return state

    def _state_of(self, job_id: str, raw: bytes | str | None) -> tuple[bytes, JobRecord | None]:
        if not raw:
            return ABSENT, None
        data = _as_bytes(raw)
        return data, self._parse(job_id, data)

    def _remember(self, job_id: str, raw: bytes, record: JobRecord) -> None:
        if record.state in TERMINAL_STATES:
            self._known.pop(job_id, None)  # nothing follows a terminal state: free the room
            return
        if job_id in self._known:
            self._known.move_to_end(job_id)
        self._known[job_id] = (raw, record)
        if len(self._known) > KNOWN_RECORDS:
            self._known.popitem(last=False)

    async def _write_many(
        self,
        job_ids: list[str],
        keys: list[bytes],
        state: list[tuple[bytes, JobRecord | None]],
        writes: list[tuple[int, JobRecord]],
        results: list[tuple[bool, JobRecord] | None],
        publish: bool,
    ) -> list[int]:
        """One compare-and-set command for the whole round (on a cluster one per node, run concurrently); returns the
        indexes that lost a race (``state`` refreshed)."""
        if not writes:
            return []
        record_json = transitions.record_json
        raws = [record_json(record) for _, record in writes]
        expected = [state[i][0] for i, _ in writes]
        write_keys = [keys[i] for i, _ in writes]
        with self._errors(f"update {len(writes)} jobs"):
            if self.cluster_mode:
                out = await self._cas_many_cluster(write_keys, expected, raws, publish)
            else:
                out = await self._cas_many_script(keys=write_keys, args=self._cas_many_args(expected, raws, publish))
        lost, born = [], []
        for (i, record), raw, result in zip(writes, raws, out, strict=True):
            if result == 1:
                results[i] = (True, record)
                if state[i][1] is None:  # the job had no record: indexed once the batch is written
                    born.append(record)
                self._remember(job_ids[i], raw, record)
            else:
                state[i] = self._state_of(job_ids[i], result)
                self._known.pop(job_ids[i], None)
                lost.append(i)
        await self.index(born)
        return lost

    def _cas_many_args(self, expected: list[bytes], raws: list[bytes], publish: bool) -> list[bytes | str | int]:
        args: list[bytes | str | int] = [self.job_ttl_s, "1" if publish else "0", len(JOB_KEY_PREFIX)]
        prefix = cl.DONE_PREFIX_CLUSTER if self.cluster_mode else c.done_channel("")
        args += (prefix, ",".join([str(len(e)) for e in expected]), b"".join(expected), *raws)
        return args

    async def _cas_many_cluster(
        self, keys: list[bytes], expected: list[bytes], raws: list[bytes], publish: bool
    ) -> list[Any]:
        """``CAS_MANY_LUA`` on a cluster: one call per node that serves some of ``keys``, all at once; the results in
        the order of ``keys``."""
        groups = list(cl.group_by_node(self.redis, keys).values())

        async def run(node: ClusterNode, idx: list[int]) -> list[Any]:
            part_keys = [keys[i] for i in idx]
            args = self._cas_many_args([expected[i] for i in idx], [raws[i] for i in idx], publish)
            return await self._eval_on(node, self._cas_many_script.sha, self._cas_many_lua, part_keys, args)

        parts = await asyncio.gather(*(run(node, idx) for node, idx in groups))
        out: list[Any] = [None] * len(keys)
        for (_, idx), part in zip(groups, parts, strict=True):
            for i, result in zip(idx, part, strict=True):
                out[i] = result
        return out

    async def _eval_on(self, node: ClusterNode, sha: str, lua: str, keys: list[bytes], args: list[Any]) -> Any:
        try:
            return await self.redis.execute_command("EVALSHA", sha, 0, len(keys), *keys, *args, target_nodes=node)
        except NoScriptError:  # a node that restarted (or joined) since connect: load it there and run again
            await self.redis.execute_command("SCRIPT LOAD", lua, target_nodes=node)
            return await self.redis.execute_command("EVALSHA", sha, 0, len(keys), *keys, *args, target_nodes=node)

    async def _mget(self, keys: list[bytes]) -> list[Any]:
        """MGET, split per slot on a cluster (``mget_nonatomic``: every key is read, each one atomically)."""
        if self.cluster_mode:
            return list(await self.redis.mget_nonatomic(keys))
        return list(await self.redis.mget(keys))

    async def wait(self, job_id: str, timeout_s: float) -> JobRecord | None:
        """The terminal record once it exists, else the current record (None: unknown job) after ``timeout_s``.

        An outage shorter than ``timeout_s`` is waited out: a read that fails is retried with backoff, a dropped
        pub/sub connection is waited for and the record read again once it is back, and the periodic re-read
        (``fleet.store.recheck``) delivers a terminal record whose notice was lost. Only a record that cannot be
        read at the deadline raises ``StoreError``.
        """
        if timeout_s <= 0:
            return await self.get(job_id)
        deadline = asyncio.get_running_loop().time() + timeout_s
        record, _ = await self._try_get(job_id)  # the common poll of a finished job costs no subscription
        if record is not None and record.terminal:
            return record
        self._recheck.start()
        return await self._watch_until(job_id, deadline)

    async def _watch_until(self, job_id: str, deadline: float) -> JobRecord | None:
        loop = asyncio.get_running_loop()
        channel = self._done_channel(job_id)
        backoff_s = WAIT_BACKOFF_S[0]
        while True:
            future = await self._mux.watch(channel, max(deadline - loop.time(), 0.0))
            try:
                record, error = await self._try_get(job_id)  # after subscribing: a completion is seen here
                if record is not None and record.terminal:
                    return record
                remaining_s = deadline - loop.time()
                if remaining_s <= 0:
                    if error is not None:
                        raise error
                    return record
                # A failed read is retried after a backoff, also while the subscription holds.
                pause_s = min(remaining_s, backoff_s) if error is not None else remaining_s
                backoff_s = min(backoff_s * 2, WAIT_BACKOFF_S[1]) if error is not None else WAIT_BACKOFF_S[0]
                try:
                    async with asyncio.timeout(pause_s):
                        payload = await future
                except TimeoutError:
                    continue  # read again (the last time at the deadline)
            finally:
                self._mux.release(channel, future)
            if payload is not None:
                return self._parse(job_id, payload)
            # None: the pub/sub connection dropped or came back, so a notice may have been lost. Watching again
            # waits for the connection; the read after it sees what was written meanwhile.

    async def _try_get(self, job_id: str) -> tuple[JobRecord | None, StoreError | None]:
        """``get``, with a retriable failure returned instead of raised (a corrupt record still raises)."""
        try:
            return await self.get(job_id), None
        except StoreError as exc:
            if not exc.retriable:
                raise
            log.debug("waiter of job %s could not read its record: %s", job_id, exc.message)
            return None, exc

    async def _get_raw(self, job_id: str) -> bytes | None:
        with self._errors(f"read job {job_id!r}"):
            raw = await self.redis.get(c.job_key(job_id))
        return None if raw is None else _as_bytes(raw)

    async def _compare_and_set(
        self, job_id: str, expected: bytes | None, new: bytes, *, publish: bool
    ) -> tuple[bool, bytes | None]:
        """Write ``new`` if the key still holds ``expected``; otherwise return what it holds now."""
        channel = self._done_channel(job_id) if publish else ""
        args: list[bytes | str | int] = [expected or b"", new, self.job_ttl_s, channel]
        with self._errors(f"update job {job_id!r}"):
            result = await self._cas(keys=[c.job_key(job_id)], args=args)
        if int(result[0]) == 1:
            return True, None
        current = _as_bytes(result[1])
        return False, current or None

    def _parse(self, job_id: str, raw: bytes | str) -> JobRecord:
        try:
            return parse_record(raw)
        except ValueError as exc:  # pydantic's ValidationError for JSON, ValueError for a bad packed record
            error = StoreError(f"the record of job {job_id!r} at {self.display_url} is not a valid job record: {exc}")
            error.retriable = False  # reading it again will not help
            raise error from exc

    def _contention(self, job_id: str) -> StoreError:
        return StoreError(f"job {job_id!r} changed {MAX_CAS_ATTEMPTS} times while it was being updated; giving up")

    @contextlib.contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise StoreError(f"result store at {self.display_url} could not {action}: {exc}; {HINT}") from exc
        except (RedisError, RedisClusterException, LookupError) as exc:  # LookupError: a slot no node serves
            raise StoreError(f"result store at {self.display_url} could not {action}: {exc}") from exc


def _client(
    url: str, socket_timeout_s: float, connect_timeout_s: float, max_connections: int, link_options: dict[str, Any]
) -> aioredis.Redis:
    # A blocking pool: a burst of waiters queues for a connection instead of failing with "Too many connections".
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=socket_timeout_s,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        socket_keepalive=True,
        health_check_interval=30,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=1),
        **link_options,
    )
    pool.connection_class = with_hiredis_packing(pool.connection_class)  # before any connection is made
    return aioredis.Redis.from_pool(pool)


_DONE_PREFIX = c.done_channel("")


def _job_of_channel(channel: str) -> str | None:
    return channel[len(_DONE_PREFIX) :] if channel.startswith(_DONE_PREFIX) else None


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value
