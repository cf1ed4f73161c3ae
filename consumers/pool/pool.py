"""``ModelPool``: the loaded model handlers of one worker process, keyed by ``(model name, version)``, within a memory
budget, shared by every ``Worker`` of the process.

How a batch gets its handler (``use``):

1. A loaded entry is marked busy (never evicted while a batch computes on it) and becomes the most recently used.
2. A key whose last load failed less than ``retry_after_s`` ago fails at once with the same ``ModelUnavailable``:
   a stream of jobs for a broken model fails fast, not with a load per batch; the first demand after the back-off
   tries again.
3. Otherwise the key is loaded, single-flight: every concurrent demand waits on the same load task (shielded, so a
   waiter cancelled by a drain does not cancel the load others wait for). Loads run one at a time (``_load_lock``),
   in a thread: construction, ``load`` and ``warmup`` never block the event loop, and the resident-memory growth
   measured across one load is that load's (``fleet.consumers.pool.budget``).
4. Room is made by evicting idle entries least recently used first (``fleet.consumers.pool.lru``) until the sum of
   sizes fits the budget. A key loaded before is evicted for *before* its load, with the size it had; a key never
   seen is measured after its load and the evictions follow it, so a first load of a model of unknown size may
   pass the budget by that model for the length of its load. When only busy entries stand in the way, the load
   waits for a batch to finish (a handler is busy for one batch, never across an await of another key).
5. A model that alone is larger than the budget is refused (``ModelUnavailable``, remembered like a failure).

A failed load leaves every other entry as it was. ``close`` unloads everything (the composition root calls it after
its workers stopped). Counts and sizes go to the metrics of ``fleet.consumers.metrics`` (``fleet_worker_model_*``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fleet.consumers import metrics
from fleet.consumers.handlers.base import ModelHandler
from fleet.consumers.pool.budget import format_bytes, handler_bytes, resident_bytes
from fleet.consumers.pool.lru import evictions
from fleet.errors import ModelUnavailable

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (model name, version)
DEFAULT_RETRY_AFTER_S = 30.0


@dataclass(slots=True)
class Entry:
    handler: ModelHandler[Any, Any]
    size: int
    busy: int = 0  # batches computing on it now


class ModelPool:
    """Loaded handlers by ``(model, version)`` within ``budget_bytes`` (None: no budget, nothing is evicted).

    Args:
        budget_bytes: the bytes the loaded models may take in all (``fleet.consumers.pool.budget.budget_bytes``
            turns a flag into it).
        retry_after_s: how long a failed or refused load is remembered: demands meanwhile fail at once.
        clock: monotonic seconds (tests pass their own).
        on_change: called on the event loop after each load and unload (workers send a heartbeat).
    """

    def __init__(
        self,
        budget_bytes: int | None = None,
        *,
        retry_after_s: float = DEFAULT_RETRY_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[], object] | None = None,
    ) -> None:
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0 or None, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.on_change: list[Callable[[], object]] = [on_change] if on_change is not None else []
        self._entries: OrderedDict[Key, Entry] = OrderedDict()  # least recently used first
        self._loading: dict[Key, asyncio.Task[Entry]] = {}
        self._failed: dict[Key, tuple[float, ModelUnavailable]] = {}  # until (clock), the error
        self._sizes: dict[Key, int] = {}  # each key's size when it was last loaded
        self._load_lock = asyncio.Lock()
        self._released = asyncio.Event()  # set when a batch lets go of an entry
        self._closed = False
        self.loads = 0
        self.unloads = 0
        self.failures = 0

    # -- reading --------------------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return sum(entry.size for entry in self._entries.values())

    def keys(self) -> list[Key]:
        """The loaded keys, least recently used first."""
        return list(self._entries)

    def loaded(self, model: str) -> list[str]:
        """The versions of ``model`` loaded and warm, sorted."""
        return sorted(version for name, version in self._entries if name == model)

    def handlers(self, model: str) -> dict[str, ModelHandler[Any, Any]]:
        """The loaded handlers of ``model``, by version."""
        return {version: entry.handler for (name, version), entry in self._entries.items() if name == model}

    def size_of(self, key: Key) -> int | None:
        """The bytes ``key`` took when it was last loaded (None: never loaded here)."""
        return self._sizes.get(key)

    # -- using ----------------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def use(self, key: Key, make: Callable[[], ModelHandler[Any, Any]]) -> AsyncIterator[ModelHandler[Any, Any]]:
        """The loaded handler of ``key`` (loaded with ``make`` when it is not), busy until the block ends.

        Raises:
            ModelUnavailable: the load failed now or within the back-off, or the model is larger than the budget.
        """
        entry = await self._acquire(key, make)
        try:
            yield entry.handler
        finally:
            entry.busy -= 1
            self._released.set()

    async def _acquire(self, key: Key, make: Callable[[], ModelHandler[Any, Any]]) -> Entry:
        while True:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                entry.busy += 1
                return entry
            failed = self._failed.get(key)
            if failed is not None:
                if self.clock() < failed[0]:
                    raise failed[1]
                del self._failed[key]
            task = self._loading.get(key)
            if task is None:
                task = asyncio.create_task(self._load(key, make), name=f"load-{key[0]}@{key[1]}")
                self._loading[key] = task
                task.add_done_callback(self._loaded)
            await asyncio.shield(task)  # raises the load's ModelUnavailable; the loop finds the entry
            # Another load may have evicted it between the end of this one and now (it was idle): load it again.

    # -- loading and unloading ------------------------------------------------------------------------------
    def _loaded(self, task: asyncio.Task[Entry]) -> None:
        for key, loading in list(self._loading.items()):
            if loading is task:
                del self._loading[key]
        if not task.cancelled():
            task.exception()  # retrieved: its waiters may all have been cancelled

    async def _load(self, key: Key, make: Callable[[], ModelHandler[Any, Any]]) -> Entry:
        async with self._load_lock:
            if self._closed:
                raise ModelUnavailable(*key, "the worker is stopping")
            known = self._sizes.get(key)
            if known is not None:
                self._refuse_oversized(key, known)
                await self._make_room(known)
            started = time.perf_counter()
            try:
                handler, size = await asyncio.to_thread(_load_measured, make)
            except Exception as exc:
                raise self._failure(key, f"{type(exc).__name__}: {exc}") from exc
            seconds = time.perf_counter() - started
            try:
                self._refuse_oversized(key, size)
            except ModelUnavailable:
                await _close_quietly(key, handler)
                raise
            await self._make_room(size)
            entry = self._entries[key] = Entry(handler, size)
            self._sizes[key] = size
            self.loads += 1
            metrics.MODEL_LOADS.labels(*key).inc()
            metrics.MODEL_LOAD_SECONDS.labels(*key).observe(seconds)
            metrics.MODEL_LOADED_BYTES.labels(*key).set(size)
            log.info(
                "model pool: %s@%s loaded in %.2fs (%s; %s of %s in use)",
                *key,
                seconds,
                format_bytes(size),
                format_bytes(self.used_bytes),
                format_bytes(self.budget_bytes) if self.budget_bytes is not None else "no budget",
            )
            self._changed()
            return entry

    def _refuse_oversized(self, key: Key, size: int) -> None:
        if self.budget_bytes is not None and size > self.budget_bytes:
            cause = f"it takes {format_bytes(size)}, more than the worker's whole memory budget of " + format_bytes(
                self.budget_bytes
            )
            raise self._failure(key, cause)

    def _failure(self, key: Key, cause: str) -> ModelUnavailable:
        error = ModelUnavailable(*key, cause, self.retry_after_s)
        self._failed[key] = (self.clock() + self.retry_after_s, error)
        self.failures += 1
        metrics.MODEL_LOAD_FAILURES.labels(*key).inc()
        log.warning("model pool: %s", error.message)
        return error

    async def _make_room(self, needed: int) -> None:
        """Evict idle entries, least recently used first, until ``needed`` more bytes fit; wait for busy ones."""
        while True:
            busy = {key for key, entry in self._entries.items() if entry.busy}
            sizes = {key: entry.size for key, entry in self._entries.items()}
            chosen = evictions(list(self._entries), sizes, busy, needed, self.budget_bytes)
            if chosen is not None:
                for key in chosen:
                    await self.unload(key)
                return
            self._released.clear()
            await self._released.wait()

    async def unload(self, key: Key) -> bool:
        """Close and forget ``key`` if it is loaded and idle; False otherwise."""
        entry = self._entries.get(key)
        if entry is None or entry.busy:
            return False
        del self._entries[key]
        await _close_quietly(key, entry.handler)
        self.unloads += 1
        metrics.MODEL_UNLOADS.labels(*key).inc()
        metrics.MODEL_LOADED_BYTES.labels(*key).set(0)
        log.info("model pool: %s@%s unloaded (%s freed)", *key, format_bytes(entry.size))
        self._changed()
        return True

    async def close(self) -> None:
        """Unload every model (after the workers stopped: nothing is busy). Idempotent."""
        self._closed = True
        if self._loading:
            await asyncio.gather(*self._loading.values(), return_exceptions=True)
        for key in list(self._entries):
            self._entries[key].busy = 0
            await self.unload(key)

    def _changed(self) -> None:
        for hook in self.on_change:
            try:
                hook()
            except Exception:
                log.exception("model pool: a change hook failed")


def _load_measured(make: Callable[[], ModelHandler[Any, Any]]) -> tuple[ModelHandler[Any, Any], int]:
    """In a thread: construct, load and warm up a handler; its size (``budget.handler_bytes``)."""
    before = resident_bytes()
    handler = make()
    try:
        handler.load()
        handler.warmup()
    except BaseException:
        with contextlib.suppress(Exception):
            handler.close()
        raise
    after = resident_bytes()
    growth = after - before if after is not None and before is not None else None
    return handler, handler_bytes(handler, growth)


async def _close_quietly(key: Key, handler: ModelHandler[Any, Any]) -> None:
    try:
        await asyncio.to_thread(handler.close)
    except Exception:
        log.exception("model pool: closing %s@%s failed", *key)
