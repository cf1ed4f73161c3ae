"""The periodic re-read that heals lost completion notices.

A completion is announced once, on ``fleet:done:<id>``. Redis pub/sub keeps nothing: a notice published while the
gateway's pub/sub connection was down (or while the server itself was restarting, by a writer whose PUBLISH was
lost with it) never arrives. The reconnection wake-up of ``PubSubMux`` covers the drops it notices; this loop
covers the rest, whatever their cause: every ``interval_s`` it reads the records of every watched job, in batches
of ``batch`` keys per MGET, and hands each terminal one to its waiters as if its notice had arrived. A thousand
waiters cost one MGET of a thousand small records (a job that has not ended has no output yet) per interval, not a
thousand timers and reads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from redis import asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from fleet import constants as c
from fleet.store.packed import parse_record
from fleet.store.pubsub import PubSubMux
from fleet.tasks import cancel_and_wait

log = logging.getLogger(__name__)

RECHECK_INTERVAL_S = 5.0  # the longest a waiter waits for a terminal record whose notice was lost
RECHECK_BATCH = 500  # keys per MGET
CHANNEL_PREFIX = c.done_channel("")


class Rechecker:
    """Re-reads the records of ``mux``'s watched jobs every ``interval_s`` and delivers the terminal ones."""

    def __init__(
        self,
        redis: aioredis.Redis | RedisCluster,
        mux: PubSubMux | Any,
        *,
        interval_s: float = RECHECK_INTERVAL_S,
        batch: int = RECHECK_BATCH,
        job_of_channel: Callable[[str], str | None] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self._redis = redis
        self._mux = mux
        self.interval_s = interval_s
        self._batch = batch
        self._job_of = job_of_channel or _job_of_channel
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.delivered = 0  # terminal records handed over by a re-read (their notice was lost or late)

    def start(self) -> None:
        """Start the loop (idempotent); ``RedisStore.wait`` calls it with the first waiter."""
        if self._task is None and not self._closed:
            self._task = asyncio.create_task(self._run(), name="fleet-store-recheck")

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.recheck()
            except (RedisError, OSError) as exc:
                # The store is down: the waiters wait for the reconnection, and the next tick tries again.
                log.debug("re-reading the watched records failed: %r", exc)
            except Exception:
                log.exception("re-reading the watched records failed")

    async def recheck(self) -> int:
        """One pass over every watched job; returns how many terminal records it delivered."""
        jobs = {ch: job for ch in self._mux.watched() if (job := self._job_of(ch)) is not None}
        channels = list(jobs)
        found = 0
        for start in range(0, len(channels), self._batch):
            chunk = channels[start : start + self._batch]
            keys = [c.job_key(jobs[ch]) for ch in chunk]
            if isinstance(self._redis, RedisCluster):
                raws = await self._redis.mget_nonatomic(keys)  # per slot: a cluster refuses a cross-slot MGET
            else:
                raws = await self._redis.mget(keys)
            for channel, raw in zip(chunk, raws, strict=True):
                if raw and _is_terminal(raw):
                    self._mux.deliver(channel, raw)
                    found += 1
        if found:
            self.delivered += found
            log.debug("re-read %d watched records: %d had ended", len(channels), found)
        return found


def _job_of_channel(channel: str) -> str | None:
    """The job id of a completion channel ``fleet:done:<id>`` (None for any other channel, e.g. a DAG run's)."""
    return channel[len(CHANNEL_PREFIX) :] if channel.startswith(CHANNEL_PREFIX) else None


def _is_terminal(raw: bytes | str) -> bool:
    try:
        return parse_record(raw).terminal
    except ValueError:  # pydantic's ValidationError, or a bad packed record
        return False  # the waiter's own read reports a corrupt record
