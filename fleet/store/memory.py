"""The embedded result store: job records in a dict, completion notifications through asyncio futures.

It honours the same contract as the Redis store (``fleet.store.base``), TTL included. Records are kept as the JSON
that Redis would hold, so an output that would not survive Redis fails here too, and no caller can change a stored
record through an object it was handed. One instance is shared by the gateway and the workers of one process and
must be used from a single event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any

from fleet.schemas.jobs import JobError, JobRecord, JobState, StageTimings
from fleet.store import transitions
from fleet.store.base import Finish, Start
from fleet.store.jobindex import MemoryIndex, Position, Scope
from fleet.store.packed import parse_record


class MemoryStore:
    """In-process ``ResultStore``. Expiry is lazy (on access) plus a cheap sweep of the oldest records on write."""

    scheme = "memory"

    def __init__(self, *, job_ttl_s: int) -> None:
        if job_ttl_s < 1:
            raise ValueError(f"job_ttl_s must be at least 1, got {job_ttl_s}")
        self.job_ttl_s = job_ttl_s
        # job id -> (monotonic expiry, record JSON). Every write uses the same TTL and moves the entry to the end,
        # so the dict is ordered by expiry and the sweep only ever looks at its head.
        self._records: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._waiters: dict[str, set[asyncio.Future[bytes]]] = {}
        self._unpublished: dict[str, tuple[float, bytes]] = {}  # job id -> (marked or claimed at, message)
        self._index = MemoryIndex(job_ttl_s)  # the job index (fleet.store.jobindex), written with each new record

    async def connect(self) -> None:
        """Nothing to reach: the store lives in this process."""

    async def close(self) -> None:
        """Nothing to release; records stay readable."""

    async def ping(self) -> None:
        """Always reachable."""

    def __len__(self) -> int:
        self._sweep()
        return len(self._records)

    async def create(self, record: JobRecord, message: bytes | None = None) -> bool:
        if self._read(record.job_id) is not None:
            return False
        raw = transitions.record_json(record)
        self._write(record.job_id, raw)
        self._index.add(record)
        if record.terminal:  # an answer known at once (a cache hit): announced like a finish
            self._notify(record.job_id, raw)
            return True
        if message is not None:
            self._unpublished[record.job_id] = (time.time(), bytes(message))
        return True

    async def get(self, job_id: str) -> JobRecord | None:
        raw = self._read(job_id)
        return None if raw is None else parse_record(raw)

    async def get_many(self, job_ids: list[str]) -> list[JobRecord | None]:
        return [await self.get(job_id) for job_id in job_ids]

    async def delete(self, job_id: str) -> None:
        self._records.pop(job_id, None)
        self._unpublished.pop(job_id, None)

    async def published(self, job_id: str) -> None:
        self._unpublished.pop(job_id, None)

    async def claim_unpublished(self, older_than_s: float, limit: int) -> list[tuple[str, bytes | None]]:
        now = time.time()
        cutoff = now - older_than_s
        due = sorted((at, job_id) for job_id, (at, _) in self._unpublished.items() if at <= cutoff)[:limit]
        out: list[tuple[str, bytes | None]] = []
        for _, job_id in due:
            message = self._unpublished[job_id][1]
            self._unpublished[job_id] = (now, message)
            out.append((job_id, message))
        return out

    async def start(
        self,
        job_id: str,
        *,
        model: str,
        worker_id: str,
        deliveries: int,
        tenant: str | None = None,
        batch_size: int | None = None,
        strikes: int = 0,
        version: str | None = None,
    ) -> JobRecord:
        current = await self.get(job_id)
        record = transitions.started(
            current,
            job_id,
            model=model,
            worker_id=worker_id,
            deliveries=deliveries,
            now=time.time(),
            tenant=tenant,
            batch_size=batch_size,
            strikes=strikes,
            version=version,
        )
        if record is not current:
            self._write(job_id, transitions.record_json(record))
            if current is None:
                self._index.add(record)
        return record

    async def finish(
        self,
        job_id: str,
        state: JobState,
        *,
        model: str,
        output: Any = None,
        error: JobError | None = None,
        worker_id: str | None = None,
        tenant: str | None = None,
        version: str | None = None,
        device_seconds: float | None = None,
        timings: StageTimings | None = None,
        trace_id: str | None = None,
    ) -> tuple[bool, JobRecord]:
        current = await self.get(job_id)
        if current is not None and current.terminal:
            return False, current
        record = transitions.finished(
            current,
            job_id,
            state,
            model=model,
            output=output,
            error=error,
            worker_id=worker_id,
            now=time.time(),
            tenant=tenant,
            version=version,
            device_seconds=device_seconds,
            timings=timings,
            trace_id=trace_id,
        )
        raw = transitions.record_json(record)
        self._write(job_id, raw)
        if current is None:
            self._index.add(record)
        self._notify(job_id, raw)
        return True, record

    async def start_many(self, items: list[Start]) -> list[JobRecord]:
        records = []
        for it in items:
            deliveries = it.deliveries
            current = await self.get(it.job_id)
            if current is not None and transitions.foreign(current, it.model, it.tenant):
                records.append(current)  # another model's or tenant's job: left alone (no await since the read)
                continue
            if it.unread and current is not None:
                deliveries = max(deliveries, current.deliveries + 1)
            records.append(
                await self.start(
                    it.job_id,
                    model=it.model,
                    worker_id=it.worker_id,
                    deliveries=deliveries,
                    tenant=it.tenant,
                    batch_size=it.batch_size,
                    strikes=it.strikes,
                    version=it.version,
                )
            )
        return records

    async def finish_many(self, items: list[Finish]) -> list[tuple[bool, JobRecord]]:
        results = []
        for i in items:
            current = await self.get(i.job_id)
            if current is not None and transitions.foreign(current, i.model, i.tenant):
                results.append((False, current))  # another model's or tenant's job: left alone
                continue
            results.append(
                await self.finish(
                    i.job_id,
                    i.state,
                    model=i.model,
                    output=i.output,
                    error=i.error,
                    worker_id=i.worker_id,
                    tenant=i.tenant,
                    version=i.version,
                    device_seconds=i.device_seconds,
                    timings=i.timings,
                    trace_id=i.trace_id,
                )
            )
        return results

    async def index_page(
        self, scope: Scope, since: float | None, until: float | None, position: Position | None, count: int
    ) -> list[Position]:
        return self._index.page(scope, since, until, position, count)

    async def index_forget(self, scope: Scope, entries: list[Position]) -> None:
        self._index.forget(scope, entries)

    async def wait(self, job_id: str, timeout_s: float) -> JobRecord | None:
        current = await self.get(job_id)
        if (current is not None and current.terminal) or timeout_s <= 0:
            return current
        # No await between the read above and the registration below, so a finish cannot slip in between.
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        waiters = self._waiters.setdefault(job_id, set())
        waiters.add(future)
        try:
            async with asyncio.timeout(timeout_s):
                raw = await future
        except TimeoutError:
            return await self.get(job_id)
        finally:
            waiters.discard(future)
            if not waiters and self._waiters.get(job_id) is waiters:
                del self._waiters[job_id]
        return parse_record(raw)

    def _read(self, job_id: str) -> bytes | None:
        entry = self._records.get(job_id)
        if entry is None:
            return None
        expires_at, raw = entry
        if expires_at <= time.monotonic():
            del self._records[job_id]
            return None
        return raw

    def _write(self, job_id: str, raw: bytes) -> None:
        self._records[job_id] = (time.monotonic() + self.job_ttl_s, raw)
        self._records.move_to_end(job_id)
        self._sweep()

    def _sweep(self) -> None:
        now = time.monotonic()
        while self._records:
            job_id, (expires_at, _) = next(iter(self._records.items()))
            if expires_at > now:
                return
            del self._records[job_id]

    def _notify(self, job_id: str, raw: bytes) -> None:
        for future in self._waiters.get(job_id, ()):
            if not future.done():
                future.set_result(raw)
