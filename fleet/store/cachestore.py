"""The shared levels of the result caches: L2 entries (exact, with a TTL) and the L3 vector log.

``CacheStore`` is the seam, with an in-memory implementation (``fleet up``'s embedded default, one process) and a
Redis one beside the result store (``fleet.store.bundle.Stores``), as for the DAG and dead-letter stores.

* ``get(key)`` / ``put(key, value, ttl_s)``: one L2 entry under ``fleet.constants.cache_entry_key``.
* ``append_vector(log, entry, max_entries, ttl_s)`` adds an L3 entry to a model version's vector log (a Redis
  stream capped near ``max_entries``, ``fleet.constants.cache_vectors_key``); ``read_vectors(log, after, limit)``
  returns the entries after the position ``after`` (``"0"``: from the oldest kept), so that each gateway tails the
  log into its FAISS index and a restarted gateway replays it.

Failures are ``StoreError``; the gateway's cache treats every one as a miss.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from cachetools import TTLCache

from fleet.store.redis_errors import RedisErrors, text

if TYPE_CHECKING:
    pass

MEMORY_L2_MAX_ENTRIES = 1_000_000  # bound of the embedded store's L2 (entries also leave at their TTL)


@dataclass(frozen=True, slots=True)
class VectorEntry:
    """One L3 entry: the L2 key of the output, the request's text, its unit vector (float32 bytes), and the tenant
    whose request filled it (None: a model shared across tenants, or an entry written before tenants)."""

    key: str
    text: str
    vector: bytes
    tenant: str | None = None


class CacheStore(Protocol):
    scheme: str

    async def get(self, key: str) -> bytes | None: ...

    async def put(self, key: str, value: bytes, ttl_s: int) -> None: ...

    async def append_vector(self, log: str, entry: VectorEntry, max_entries: int, ttl_s: int) -> None: ...

    async def read_vectors(self, log: str, after: str, limit: int) -> list[tuple[str, VectorEntry]]: ...


class MemoryCacheStore:
    """``CacheStore`` in this process: L2 in a ``cachetools.TTLCache`` (per-entry TTL by expiry time)."""

    scheme = "memory"

    def __init__(self) -> None:
        self._entries: TTLCache[str, tuple[float, bytes]] = TTLCache(MEMORY_L2_MAX_ENTRIES, ttl=float("inf"))
        self._logs: dict[str, deque[tuple[int, float, VectorEntry]]] = {}
        self._seq = itertools.count(1)

    async def get(self, key: str) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        expires_at, value = entry
        if expires_at <= time.monotonic():
            self._entries.pop(key, None)
            return None
        return value

    async def put(self, key: str, value: bytes, ttl_s: int) -> None:
        self._entries[key] = (time.monotonic() + ttl_s, bytes(value))

    async def append_vector(self, log: str, entry: VectorEntry, max_entries: int, ttl_s: int) -> None:
        entries = self._logs.get(log)
        if entries is None or entries.maxlen != max_entries:
            entries = self._logs[log] = deque(entries or (), maxlen=max_entries)
        entries.append((next(self._seq), time.monotonic() + ttl_s, entry))

    async def read_vectors(self, log: str, after: str, limit: int) -> list[tuple[str, VectorEntry]]:
        start, now = int(after.split("-")[0]), time.monotonic()
        out = []
        for seq, expires_at, entry in self._logs.get(log, ()):
            if seq > start and expires_at > now:
                out.append((str(seq), entry))
                if len(out) >= limit:
                    break
        return out


class RedisCacheStore:
    """``CacheStore`` in the result store's Redis: L2 entries are strings with ``EX``; a vector log is a stream
    (``XADD ... MAXLEN ~``), whose TTL each append renews, so the log of a model version no longer served ends."""

    scheme = "redis"

    def __init__(self, redis: Any, display_url: str) -> None:
        """Args: redis: a ``redis.asyncio.Redis`` answering bytes (a ``RedisStore``'s ``redis``)."""
        self._redis = redis
        self._url = display_url

    async def get(self, key: str) -> bytes | None:
        async with RedisErrors("result cache", self._url, f"read {key}"):
            value = await self._redis.get(key)
        return None if value is None else bytes(value)

    async def put(self, key: str, value: bytes, ttl_s: int) -> None:
        async with RedisErrors("result cache", self._url, f"write {key}"):
            await self._redis.set(key, value, ex=ttl_s)

    async def append_vector(self, log: str, entry: VectorEntry, max_entries: int, ttl_s: int) -> None:
        fields: dict[str | bytes, str | bytes] = {"key": entry.key, "text": entry.text, "vector": entry.vector}
        if entry.tenant is not None:
            fields["tenant"] = entry.tenant
        async with RedisErrors("result cache", self._url, f"append to {log}"):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.xadd(log, fields, maxlen=max_entries, approximate=True)
                pipe.expire(log, ttl_s)
                await pipe.execute()

    async def read_vectors(self, log: str, after: str, limit: int) -> list[tuple[str, VectorEntry]]:
        async with RedisErrors("result cache", self._url, f"read {log}"):
            reply = await self._redis.xread({log: after}, count=limit)
        out = []
        for _, messages in reply or ():
            for position, fields in messages:
                tenant = fields.get(b"tenant")
                entry = VectorEntry(
                    text(fields[b"key"]),
                    text(fields[b"text"]),
                    bytes(fields[b"vector"]),
                    None if tenant is None else text(tenant),
                )
                out.append((text(position), entry))
        return out
