"""The audit log of operator actions: who scaled, paused, drained, redrove, purged, created or revoked a key, when.

In Redis a capped stream (``AUDIT_STREAM_KEY``, about ``AUDIT_MAX_ENTRIES`` of the newest entries, trimmed by
``XADD MAXLEN ~``), so every gateway appends to the same log; in memory a bounded deque for ``fleet up``.
``latest(limit)`` is the newest entries first.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Protocol

from fleet import constants as c
from fleet.schemas.keys import AuditEntry
from fleet.store.redis_errors import RedisErrors

if TYPE_CHECKING:
    from fleet.store.redis import RedisStore


class AuditLog(Protocol):
    async def append(self, entry: AuditEntry) -> None: ...

    async def latest(self, limit: int) -> list[AuditEntry]: ...


class MemoryAuditLog:
    """The audit log of ``fleet up`` on the embedded store: one per memory result store."""

    def __init__(self, max_entries: int = c.AUDIT_MAX_ENTRIES) -> None:
        self._entries: collections.deque[str] = collections.deque(maxlen=max_entries)

    async def append(self, entry: AuditEntry) -> None:
        self._entries.append(entry.model_dump_json())

    async def latest(self, limit: int) -> list[AuditEntry]:
        newest = list(self._entries)[::-1][: max(0, limit)]
        return [AuditEntry.model_validate_json(raw) for raw in newest]


class RedisAuditLog:
    """The audit stream in the Redis of ``store`` (a ``RedisStore``: its client)."""

    def __init__(self, store: RedisStore, max_entries: int = c.AUDIT_MAX_ENTRIES) -> None:
        self.redis = store.redis
        self.display_url = store.display_url
        self.max_entries = max_entries

    async def append(self, entry: AuditEntry) -> None:
        async with RedisErrors("audit log", self.display_url, "append an entry"):
            await self.redis.xadd(
                c.AUDIT_STREAM_KEY, {"entry": entry.model_dump_json()}, maxlen=self.max_entries, approximate=True
            )

    async def latest(self, limit: int) -> list[AuditEntry]:
        async with RedisErrors("audit log", self.display_url, "read the entries"):
            rows = await self.redis.xrevrange(c.AUDIT_STREAM_KEY, count=max(1, limit))
        out = []
        for _, fields in rows[: max(0, limit)]:
            raw = fields.get(b"entry", fields.get("entry"))
            if raw is not None:
                out.append(AuditEntry.model_validate_json(raw))
        return out
