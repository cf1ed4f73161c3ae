"""The L3 (semantic) level: one FAISS index per model version in each gateway, kept in step through the store.

Every filled L3 entry is appended to its model version's vector log in the cache store (``CacheStore
.append_vector``: a capped Redis stream beside the L2 entry, or a list in memory) and added to the local index at
once. A sync task reads each log from the position it reached every ``cache_l3_sync_interval_s``, so an entry one
gateway filled answers in every gateway shortly after, and a gateway that starts (or restarts) replays the log from
its oldest kept entry. Entries are deduplicated by their L2 key, so a gateway reading back its own entries adds
nothing twice.

A log that cannot be read is retried at the next interval (logged once per outage); the index keeps answering
from what it holds.

Tenants: a model version not shared across tenants (``FLEET_CACHE_SHARED``) keeps one index per tenant, created
when its first entry comes; an entry names its tenant in the log and goes to that tenant's index only, and a
lookup searches only the index of its own tenant, so a semantic hit can never answer with what another tenant
asked, and its cost is that of one tenant's entries (each index is bounded by ``max_entries``). A shared model
version keeps one index, for entries with no tenant. An entry that does not fit its slot (no tenant in a
per-tenant slot: written before tenants; a tenant in a shared slot: written before the model was shared) is
skipped.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import numpy as np

from fleet import constants as c
from fleet.errors import StoreError
from fleet.producers.gateway.cache.semantic_index import Match, Mirror, SemanticIndex
from fleet.store.cachestore import CacheStore, VectorEntry
from fleet.tasks import cancel_and_wait, wait_event

logger = logging.getLogger(__name__)

SYNC_BATCH = 1000  # log entries read per call


@dataclass(slots=True)
class _Slot:
    """One model version's indexes (one per tenant, or one under ``None`` when shared), its log and how far this
    gateway has read it."""

    log: str
    shared: bool
    dim: int
    indexes: dict[str | None, SemanticIndex] = field(default_factory=dict)
    position: str = "0"
    lock: asyncio.Lock | None = None
    failing: bool = False

    def fits(self, tenant: str | None) -> bool:
        """True when an entry of ``tenant`` belongs in this slot (see the module docstring)."""
        return (tenant is None) == self.shared


@dataclass(frozen=True, slots=True)
class L3Options:
    dim: int  # the vectors' size where ``serve`` is not given one
    max_entries: int
    nprobe: int
    sync_interval_s: float
    ttl_s: int
    timeout_s: float
    mirror: Mirror | None = None  # searches on a GPU copy of each index (``semantic_index.gpu_mirror``)


class SemanticLevel:
    """L3 for the models that use it: ``match`` finds an earlier request, ``remember`` adds one. The vectors come
    from each model's embedder (``embedder.Embedders``, held by the result cache)."""

    def __init__(self, store: CacheStore, options: L3Options) -> None:
        self.store = store
        self.options = options
        self._slots: dict[tuple[str, str], _Slot] = {}
        self._sync: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()  # watched by the sync loop too: a cancellation can be swallowed below it

    def serve(self, model: str, version: str, shared: bool = False, dim: int | None = None) -> None:
        """Keep indexes for ``model`` at ``version`` (called at start-up for each model with L3 on): one per tenant,
        or one for every tenant when ``shared``, of vectors of ``dim`` floats (default ``options.dim``: the size
        of the model's embedder's vectors)."""
        key = (model, version)
        if key not in self._slots:
            log = c.cache_vectors_key(model, version)
            self._slots[key] = _Slot(log, shared, dim or self.options.dim, lock=asyncio.Lock())

    def _new_index(self, dim: int) -> SemanticIndex:
        options = self.options
        return SemanticIndex(dim, max_entries=options.max_entries, nprobe=options.nprobe, mirror=options.mirror)

    def index_of(self, model: str, version: str, tenant: str | None = None) -> SemanticIndex:
        """The index of ``tenant`` (None: the shared one), created empty when it has none yet."""
        slot = self._slots[(model, version)]
        index = slot.indexes.get(tenant)
        if index is None:
            index = slot.indexes[tenant] = self._new_index(slot.dim)
        return index

    def entries(self, model: str, version: str) -> int:
        """Entries held for ``model`` at ``version``, every tenant together."""
        return sum(len(index) for index in self._slots[(model, version)].indexes.values())

    async def start(self) -> None:
        """Replay the logs once, then keep tailing them in the background."""
        await self.sync_once()
        self._sync = asyncio.create_task(self._sync_loop(), name="l3-sync")

    async def stop(self) -> None:
        """End the sync loop, even one whose cancellation a client library swallowed (a gateway's shutdown once
        waited 30 s on a sync task back asleep after its cancel)."""
        self._stopped.set()
        if self._sync is not None:
            await cancel_and_wait([self._sync])

    async def match(
        self, model: str, version: str, vector: np.ndarray, text: str, threshold: float, tenant: str | None = None
    ) -> Match | None:
        """The nearest earlier request of ``tenant`` (None: of the shared index) that passes ``threshold``."""
        slot = self._slots[(model, version)]
        index = slot.indexes.get(tenant)
        if index is None:
            return None
        assert slot.lock is not None
        async with slot.lock:  # no await inside: the search runs on the loop, well under a millisecond
            return index.search(vector[None, :], [text], threshold)[0]

    def forget(self, model: str, version: str, key: str, tenant: str | None = None) -> None:
        """The entry's output is gone from L2: stop answering with it."""
        index = self._slots[(model, version)].indexes.get(tenant)
        if index is not None:
            index.discard(key)

    async def remember(self, model: str, version: str, entry: VectorEntry, vector: np.ndarray) -> None:
        """Add the entry here (to the index of ``entry.tenant``) and append it to the shared log. Raises
        ``StoreError`` when the log write fails (the local index has it anyway)."""
        slot = self._slots[(model, version)]
        await self._add(slot, entry.tenant, [entry], vector[None, :])
        async with asyncio.timeout(self.options.timeout_s):
            await self.store.append_vector(slot.log, entry, self.options.max_entries, self.options.ttl_s)

    async def sync_once(self) -> None:
        """Read every log from where this gateway stopped; add what is new."""
        for (model, version), slot in self._slots.items():
            try:
                while await self._sync_slot(slot):
                    pass
            except (StoreError, TimeoutError) as exc:
                if not slot.failing:
                    logger.warning("L3 index of %s v%s cannot read its log: %s", model, version, exc)
                slot.failing = True
            else:
                if slot.failing:
                    logger.info("L3 index of %s v%s reads its log again", model, version)
                slot.failing = False

    async def _sync_slot(self, slot: _Slot) -> bool:
        """One read of the log; True when there may be more."""
        async with asyncio.timeout(max(self.options.timeout_s, 1.0)):
            rows = await self.store.read_vectors(slot.log, slot.position, SYNC_BATCH)
        if not rows:
            return False
        slot.position = rows[-1][0]
        by_tenant: dict[str | None, list[VectorEntry]] = {}
        for _, entry in rows:
            if len(entry.vector) == 4 * slot.dim and slot.fits(entry.tenant):
                by_tenant.setdefault(entry.tenant, []).append(entry)
        for tenant, entries in by_tenant.items():
            vectors = np.frombuffer(b"".join(e.vector for e in entries), dtype=np.float32).reshape(len(entries), -1)
            await self._add(slot, tenant, entries, vectors)
        return len(rows) >= SYNC_BATCH

    async def _add(self, slot: _Slot, tenant: str | None, entries: list[VectorEntry], vectors: np.ndarray) -> None:
        assert slot.lock is not None
        keys, texts = [e.key for e in entries], [e.text for e in entries]
        index = slot.indexes.get(tenant)
        if index is None:
            index = slot.indexes[tenant] = self._new_index(slot.dim)
        async with slot.lock:  # adding may train or evict (hundreds of ms): off the loop
            await asyncio.to_thread(index.add, vectors, keys, texts)

    async def _sync_loop(self) -> None:
        while not await wait_event(self._stopped, self.options.sync_interval_s):
            try:
                await self.sync_once()
            except Exception:
                logger.exception("L3 sync failed; retrying at the next interval")
