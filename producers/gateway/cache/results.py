"""The gateway's result caches: L1 in-process, L2 exact in the store, L3 semantic (``l3``).

Per model opt-in (``FLEET_CACHE``). The key of a request is the sha256 of the canonical JSON of ``{model, version,
input, tenant}`` (``fleet.schemas.jobs.input_digest``), under ``fleet.constants.cache_entry_key(model, version,
digest)``:
a new ``ModelSpec.version`` never reads an older version's entries, and one tenant never reads another's. A model
named in ``FLEET_CACHE_SHARED`` leaves the tenant out of the key (``{model, version, input}``, as before tenants)
and keeps one L3 index: its entries answer every tenant. Otherwise L3 searches only the requesting tenant's index
(``l3``). A lookup tries the levels in order and stops at the first hit:

* L1: a ``cachetools.TTLCache`` (LRU with a TTL) of outputs in this gateway;
* L2: the cache store (``fleet.store.cachestore``), one entry per key with a TTL; a hit is copied into L1;
* L3: the request's text (the input field ``ModelSpec.cache_text``) is embedded by the model's embedder
  (``ModelSpec.cache_embedder``: ``embed`` unless the model names a cheaper or better one) and the model version's FAISS
  index answers its nearest earlier request; a similarity at or above the threshold (whose text also agrees on
  numbers and negations) is a hit, and that request's output (from L1 or L2) answers. The hit is copied into L1
  under the request's own key.

A level that fails (the store is down or slow, the embedder cannot load) is a miss, counted
``result="error"``; a lookup never raises. Fills: after a miss the gateway waits (in the background, at most
``cache_fill_wait_s``) for the job's terminal record and stores a ``succeeded`` output in every level the model
uses, reusing the vector the L3 lookup computed. An entry keeps the output in the encoding of the request
that filled it; a hit is converted to the encoding its request asks for (``fleet.encoding``): one entry per
input, not per encoding, so float and base64 requests of one text share it (and its hit rate).
Filling in the gateway, not in the worker's settle path, keeps the
cache out of the ack path entirely (a cache that cannot be written never delays or fails a job) and puts the entry
in this gateway's L1 at once; a gateway that dies before the result leaves that one entry unfilled.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cachetools import TTLCache

from fleet import constants as c
from fleet.encoding import DEFAULT_ENCODING, convert_output
from fleet.errors import ConfigError, StoreError
from fleet.producers.gateway.cache.embedder import (
    BatchingEmbedder,
    Embedders,
    TextModel,
    check_embedders,
    embedder_dim,
    load_embedder,
)
from fleet.producers.gateway.cache.l3 import L3Options, SemanticLevel
from fleet.producers.gateway.cache.semantic_index import gpu_mirror, index_device
from fleet.producers.gateway.metrics import (
    CACHE_FILLS,
    CACHE_L3_ENTRIES,
    CACHE_L3_READY,
    CACHE_LOOKUP_SECONDS,
    CACHE_REQUESTS,
)
from fleet.schemas.jobs import CacheLevel, JobRecord, JobState, input_digest
from fleet.schemas.models import EMBED_DIM, ModelSpec
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from fleet.store.cachestore import CacheStore, VectorEntry

logger = logging.getLogger(__name__)

MAX_PENDING_FILLS = 10_000  # misses waited on at once; beyond, a miss is not filled (counted as skipped)


@dataclass(frozen=True, slots=True)
class Hit:
    """A cached output and where it came from."""

    level: CacheLevel
    output: Any
    similarity: float | None = None


@dataclass(slots=True)
class Lookup:
    """One request's cache lookup: its key, its text and vector (L3), and the hit if there was one."""

    spec: ModelSpec
    key: str
    levels: tuple[str, ...]
    tenant: str | None = None  # whose entries it reads and fills (None: a model shared across tenants)
    text: str | None = None
    vector: np.ndarray | None = field(default=None, repr=False)
    hit: Hit | None = None


def resolve_levels(settings: FleetSettings, specs: dict[str, ModelSpec]) -> dict[str, tuple[str, ...]]:
    """Each served model's cache levels. ``all`` means l1+l2, and l3 when the spec names a text to embed.

    Raises:
        ConfigError: ``FLEET_CACHE`` names a model that is not served, or asks l3 of a model without
            ``cache_text``.
    """
    out: dict[str, tuple[str, ...]] = {}
    for model, levels in settings.cache.items():
        spec = specs.get(model)
        if spec is None:
            raise ConfigError(f"cache: model {model!r} is not served here; served: {', '.join(sorted(specs))}")
        if levels == ("all",):
            levels = ("l1", "l2", "l3") if spec.cache_text else ("l1", "l2")
        if "l3" in levels and not spec.cache_text:
            raise ConfigError(
                f"cache: model {model!r} cannot use l3: its ModelSpec names no input text to embed (cache_text)"
            )
        out[model] = levels
    return out


def cache_key(spec: ModelSpec, value: dict[str, Any], tenant: str | None = None) -> str:
    """The L2 key of ``value`` for ``spec``'s model at its version, of ``tenant`` (None: shared by every tenant).
    Raises ``ValueError`` for non-JSON input."""
    keyed: dict[str, Any] = {"model": spec.name, "version": spec.version, "input": value}
    if tenant is not None:
        keyed["tenant"] = tenant
    return c.cache_entry_key(spec.name, spec.version, input_digest(keyed))


class ResultCache:
    """The three levels for the models that opted in; ``lookup`` before a submit, ``fill_later`` after a miss."""

    def __init__(
        self,
        settings: FleetSettings,
        specs: dict[str, ModelSpec],
        store: CacheStore,
        semantic: SemanticLevel | None,
        embedders: Embedders | None = None,
    ) -> None:
        self.settings = settings
        self.levels = resolve_levels(settings, specs)
        self.shared = frozenset(settings.cache_shared)
        self.store = store
        self.semantic = semantic
        self.embedders = embedders
        self.l1: TTLCache[str, Any] = TTLCache(settings.cache_l1_max_entries, ttl=settings.cache_l1_ttl_s)
        self._timeout_s = settings.cache_timeout_ms / 1000
        self._fills: set[asyncio.Task[None]] = set()
        self._warming: asyncio.Task[None] | None = None
        if semantic is not None:
            for model, levels in self.levels.items():
                if "l3" in levels:
                    spec = specs[model]
                    dim = embedder_dim(spec.cache_embedder)
                    semantic.serve(model, spec.version, shared=model in self.shared, dim=dim)

    def uses(self, model: str) -> bool:
        return bool(self.levels.get(model))

    def scope(self, model: str, tenant: str) -> str | None:
        """Whose entries a request of ``tenant`` reads and fills: its own, or None for a shared model."""
        return None if model in self.shared else tenant

    def threshold(self, spec: ModelSpec) -> float:
        return self.settings.cache_l3_threshold or spec.cache_threshold

    async def start(self) -> None:
        if self.semantic is not None:
            await self.semantic.start()
            self._warming = asyncio.create_task(self._warm(), name="l3-warm")

    async def stop(self) -> None:
        for task in list(self._fills):
            task.cancel()
        await asyncio.gather(*self._fills, return_exceptions=True)
        if self._warming is not None:
            self._warming.cancel()
        if self.semantic is not None:
            await self.semantic.stop()
        if self.embedders is not None:
            self.embedders.close()

    async def _warm(self) -> None:
        """Load each embedder; one that fails leaves its models' L3 lookups missing, not the others'."""
        assert self.embedders is not None
        for name, embedder in self.embedders.by_name.items():
            try:
                await embedder.warm()
            except Exception as exc:
                logger.warning("the L3 embedder %s could not be loaded (its models' L3 will miss): %s", name, exc)
        if self.embedders.ready:
            CACHE_L3_READY.set(1)

    def embedder(self, model: str) -> BatchingEmbedder | None:
        """The embedder of ``model``'s L3 keys, or None when it has no L3."""
        if self.embedders is None or "l3" not in self.levels.get(model, ()):
            return None
        return self.embedders.for_model(model)

    # -- lookup ---------------------------------------------------------------------------------------------
    async def lookup(
        self,
        spec: ModelSpec,
        value: dict[str, Any],
        encoding: str = DEFAULT_ENCODING,
        tenant: str = c.DEFAULT_TENANT,
    ) -> Lookup:
        """Try each level of the model in order, for a request of ``tenant``. Never raises: a failing level is a
        miss. Only entries of ``tenant`` answer, or of every tenant for a shared model.

        One entry serves both encodings: a hit's vector fields are converted to ``encoding`` (exact both ways:
        the floats are float32 values), whichever encoding the request that filled it asked for.
        """
        found = await self._lookup(spec, value, self.scope(spec.name, tenant))
        if found.hit is not None and spec.vector_fields:
            hit = found.hit
            try:
                output = convert_output(hit.output, spec.vector_fields, encoding)
            except ValueError as exc:  # an entry that does not decode is a miss, as a failing level
                logger.warning("a cached output of %s does not convert to %s: %s", spec.name, encoding, exc)
                found.hit = None
                return found
            found.hit = Hit(hit.level, output, hit.similarity)
        return found

    async def _lookup(self, spec: ModelSpec, value: dict[str, Any], scope: str | None) -> Lookup:
        levels = self.levels[spec.name]
        found = Lookup(spec, cache_key(spec, value, scope), levels, scope)
        for level in levels:
            started = time.perf_counter()
            result = "miss"
            try:
                found.hit = await self._level(level, found, value)
                result = "hit" if found.hit is not None else "miss"
            except Exception as exc:
                result = "error"
                logger.debug("cache %s of %s failed: %s", level, spec.name, exc)
            CACHE_LOOKUP_SECONDS.labels(spec.name, level).observe(time.perf_counter() - started)
            CACHE_REQUESTS.labels(spec.name, level, result).inc()
            if found.hit is not None:
                if level != "l1" and "l1" in levels:
                    self.l1[found.key] = found.hit.output
                break
        return found

    async def _level(self, level: str, found: Lookup, value: dict[str, Any]) -> Hit | None:
        if level == "l1":
            return Hit("l1", self.l1[found.key]) if found.key in self.l1 else None
        if level == "l2":
            output = await self._read_l2(found.key)
            return None if output is None else Hit("l2", output[0])
        return await self._l3(found, value)

    async def _read_l2(self, key: str) -> tuple[Any, str | None] | None:
        async with asyncio.timeout(self._timeout_s):
            raw = await self.store.get(key)
        if raw is None:
            return None
        entry = json.loads(raw)
        return entry["output"], entry.get("text")

    async def _l3(self, found: Lookup, value: dict[str, Any]) -> Hit | None:
        text = value.get(found.spec.cache_text or "")
        embedder = self.embedder(found.spec.name)
        if self.semantic is None or embedder is None or not isinstance(text, str) or not text.strip():
            return None
        spec = found.spec
        found.text = text
        if not embedder.ready:
            return None  # still loading: a miss now rather than a request held for seconds (fill embeds later)
        found.vector = await embedder.embed(text)
        threshold = self.threshold(spec)
        match = await self.semantic.match(spec.name, spec.version, found.vector, text, threshold, found.tenant)
        if match is None:
            return None
        output = self.l1.get(match.key)
        if output is None:
            stored = await self._read_l2(match.key)
            if stored is None:
                self.semantic.forget(spec.name, spec.version, match.key, found.tenant)
                return None
            output = stored[0]
        return Hit("l3", output, match.similarity)

    # -- fill -----------------------------------------------------------------------------------------------
    def fill_later(self, found: Lookup, job_id: str, store: ResultStore) -> None:
        """Wait in the background for the job's terminal record and fill the caches with a succeeded output."""
        if len(self._fills) >= MAX_PENDING_FILLS:
            CACHE_FILLS.labels(found.spec.name, "skipped").inc()
            return
        task = asyncio.create_task(self._fill_when_done(found, job_id, store), name=f"cache-fill-{job_id}")
        self._fills.add(task)
        task.add_done_callback(self._fills.discard)

    async def _fill_when_done(self, found: Lookup, job_id: str, store: ResultStore) -> None:
        try:
            record = await store.wait(job_id, self.settings.cache_fill_wait_s)
        except StoreError as exc:
            logger.debug("cache fill of job %s: its record cannot be read: %s", job_id, exc)
            CACHE_FILLS.labels(found.spec.name, "error").inc()
            return
        await self.fill(found, record)

    async def fill(self, found: Lookup, record: JobRecord | None) -> None:
        """Store ``record``'s output under the lookup's key in every level, if the job succeeded here."""
        model = found.spec.name
        if record is None or record.state != JobState.succeeded or record.cache is not None:
            CACHE_FILLS.labels(model, "skipped").inc()
            return
        if "l1" in found.levels:
            self.l1[found.key] = record.output
        try:
            await self._fill_shared(found, record.output)
        except Exception as exc:
            logger.debug("cache fill of %s failed: %s", found.key, exc)
            CACHE_FILLS.labels(model, "error").inc()
            return
        CACHE_FILLS.labels(model, "stored").inc()

    async def _fill_shared(self, found: Lookup, output: Any) -> None:
        spec, settings = found.spec, self.settings
        if "l2" in found.levels or "l3" in found.levels:
            raw = json.dumps({"output": output, "text": found.text}, separators=(",", ":")).encode()
            async with asyncio.timeout(self._timeout_s):
                await self.store.put(found.key, raw, settings.cache_l2_ttl_s)
        embedder = self.embedder(spec.name)  # None unless the model has l3
        if self.semantic is not None and embedder is not None and found.text and embedder.ready:
            if found.vector is None:
                found.vector = await embedder.embed(found.text)
            vector = found.vector.astype(np.float32).tobytes()
            entry = VectorEntry(found.key, found.text, vector, found.tenant)
            await self.semantic.remember(spec.name, spec.version, entry, found.vector)
            CACHE_L3_ENTRIES.labels(spec.name).set(self.semantic.entries(spec.name, spec.version))


def require_l3_extras(models: list[str]) -> None:
    """Raise a ConfigError naming the extras to install when L3's FAISS or its embedding model is not installed.

    Raises:
        ConfigError: ``faiss`` (the ``cache`` extra) or ``torch``/``transformers`` (the ``models`` extra) is absent.
    """
    absent = [name for name in ("faiss", "torch", "transformers") if importlib.util.find_spec(name) is None]
    if absent:
        raise ConfigError(
            f"cache: {', '.join(models)} use the l3 cache, which needs {', '.join(absent)} (not installed): "
            "pip install 'fleet-inference[cache,models]', or give those models l1+l2 in FLEET_CACHE"
        )


def build_cache(
    settings: FleetSettings,
    specs: dict[str, ModelSpec],
    store: CacheStore,
    load_text_model: Callable[[str], TextModel] | None = None,
) -> ResultCache | None:
    """The result cache of a gateway, or None when no served model opted in (``FLEET_CACHE`` empty).

    The embedders (and with them their weights) exist only when some model uses L3: one per distinct
    ``cache_embedder`` of those models, each loaded once, in the background at start-up. ``load_text_model``
    replaces the default loader (``embedder.load_embedder`` on ``settings.device``): it gets an embedder's name
    and decides itself which names it knows.

    Raises:
        ConfigError: see ``resolve_levels``; L3's extras are missing; a model with L3 names an embedder this
            gateway cannot load (``embedder.check_embedders``).
    """
    if not settings.cache:
        return None
    levels = resolve_levels(settings, specs)
    semantic = embedders = None
    l3_specs = {model: specs[model] for model, lv in levels.items() if "l3" in lv}
    if l3_specs:
        require_l3_extras(list(l3_specs))
        if load_text_model is None:
            check_embedders(l3_specs)
        loader = load_text_model or functools.partial(load_embedder, settings.device)
        gpu = index_device(settings.device)
        logger.info("L3 cache: FAISS searches on %s", "the CPU" if gpu is None else f"GPU {gpu}")
        options = L3Options(
            dim=EMBED_DIM,
            max_entries=settings.cache_l3_max_entries,
            nprobe=settings.cache_l3_nprobe,
            sync_interval_s=settings.cache_l3_sync_interval_s,
            ttl_s=settings.cache_l2_ttl_s,
            timeout_s=settings.cache_timeout_ms / 1000,
            mirror=None if gpu is None else gpu_mirror(gpu),
        )
        semantic = SemanticLevel(store, options)
        embedders = Embedders(l3_specs, loader, settings.cache_embedder_threads)
    return ResultCache(settings, specs, store, semantic, embedders)
