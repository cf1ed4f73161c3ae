"""The gateway's text embedders for the L3 cache: concurrent lookups batched into one forward pass, off the loop.

Each model with L3 names its embedder (``ModelSpec.cache_embedder``, ``cache.embedder`` in ``model.yaml``): the
model whose vector of the request's text is the L3 key, usually a model far cheaper than the one it caches
(``extract``, a DeBERTa-v2-base-sized model, is keyed by ``embed``'s MiniLM vectors). ``EMBEDDERS`` lists the
embedders a gateway can load by name; today that is ``embed`` (all-MiniLM-L6-v2, ``fleet.consumers.handlers.embed``),
resolved by import path (``fleet.models.import_object``) so that the gateway does not import the worker package.
``check_embedders`` refuses, at start-up, a model whose embedder is not one of them.

The gateway keeps one ``BatchingEmbedder`` per distinct embedder (``Embedders``), however many models use it; each
loads its model in a worker thread on first use, on the device the worker would choose (``settings.device``).
``BatchingEmbedder.embed`` queues a text; one drain task takes whatever is queued (up to ``max_batch``), runs the
model in the embedder's own thread, and answers every caller of that batch. That thread runs torch with
``threads`` intra-op threads (``FLEET_CACHE_EMBEDDER_THREADS``, default 1; ``fleet.torch_threads``: that thread's
count alone, so a worker's model in the same process, ``fleet up``, keeps the process's).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fleet.errors import ConfigError
from fleet.models import import_object
from fleet.schemas.models import EMBED_DIM, ModelSpec
from fleet.torch_threads import set_for_this_thread

logger = logging.getLogger(__name__)

EMBED_HANDLER = "fleet.consumers.handlers.embed:EmbedHandler"


class TextModel(Protocol):
    """What the embedder needs of a model: unit vectors for texts (``EmbedHandler.embed_texts``)."""

    def embed_texts(self, texts: list[str]) -> list[list[float]]: ...


@dataclass(frozen=True, slots=True)
class EmbedderKind:
    """An embedder the gateway can load: the handler class with ``embed_texts`` and the size of its vectors."""

    handler: str
    dim: int


EMBEDDERS: dict[str, EmbedderKind] = {"embed": EmbedderKind(EMBED_HANDLER, EMBED_DIM)}


def load_embed_handler(device: str, path: str = EMBED_HANDLER) -> TextModel:
    """Build and load the handler at ``path`` on ``device`` (blocking: call it in a thread)."""
    handler = import_object(path)(device=device)
    handler.load()
    model: TextModel = handler
    return model


def load_embedder(device: str, name: str) -> TextModel:
    """Load the embedder ``name`` of ``EMBEDDERS`` on ``device`` (blocking: call it in a thread).

    Raises:
        ConfigError: ``name`` is not an embedder the gateway knows.
    """
    kind = EMBEDDERS.get(name)
    if kind is None:
        raise ConfigError(f"{name!r} is not an L3 embedder; known: {', '.join(EMBEDDERS)}")
    return load_embed_handler(device, kind.handler)


def check_embedders(specs: Mapping[str, ModelSpec], known: Mapping[str, EmbedderKind] = EMBEDDERS) -> None:
    """Refuse, before anything loads, a model whose L3 embedder the gateway cannot load.

    Raises:
        ConfigError: naming the model and its embedder.
    """
    for model, spec in specs.items():
        if spec.cache_embedder not in known:
            raise ConfigError(
                f"cache: model {model!r} keys its l3 cache with the embedder {spec.cache_embedder!r} "
                f"(cache_embedder), which this gateway cannot load; known embedders: {', '.join(known)}"
            )


def embedder_dim(name: str) -> int:
    """The size of the vectors of the embedder ``name`` (that of ``embed`` for one loaded by a test's loader)."""
    kind = EMBEDDERS.get(name)
    return EMBED_DIM if kind is None else kind.dim


class BatchingEmbedder:
    """``await embed(text)`` -> a float32 unit vector; concurrent calls share one model call."""

    def __init__(self, load: Callable[[], TextModel], *, max_batch: int = 64, threads: int = 1) -> None:
        self._load = load
        self._max_batch = max_batch
        self._threads = threads
        self._executor: ThreadPoolExecutor | None = None  # made on first use: one thread, its torch threads set
        self._model: TextModel | None = None
        self._loading = threading.Lock()  # warm() and the first batch may both want the model
        self._queue: list[tuple[str, asyncio.Future[np.ndarray]]] = []
        self._drain: asyncio.Task[None] | None = None
        self.batches = 0

    @property
    def ready(self) -> bool:
        """True once the model is loaded. Until then lookups do not wait for it (loading takes seconds)."""
        return self._model is not None

    async def embed(self, text: str) -> np.ndarray:
        """The text's vector. Raises whatever loading or running the model raised (the caller counts a miss)."""
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        self._queue.append((text, future))
        if self._drain is None or self._drain.done():
            self._drain = asyncio.create_task(self._run(), name="l3-embedder")
        return await future

    async def warm(self) -> None:
        """Load the model now (in a thread), so that the first lookup does not wait for it."""
        await asyncio.to_thread(self._ensure_model)

    def close(self) -> None:
        if self._drain is not None:
            self._drain.cancel()
        for _, future in self._queue:
            future.cancel()
        self._queue.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def _thread(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="l3-embedder",
                initializer=set_for_this_thread,
                initargs=(self._threads,),
            )
        return self._executor

    def _ensure_model(self) -> TextModel:
        with self._loading:
            if self._model is None:
                self._model = self._load()
            return self._model

    def _compute(self, texts: list[str]) -> np.ndarray:
        vectors = np.asarray(self._ensure_model().embed_texts(texts), dtype=np.float32)
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        return vectors / np.maximum(norms, 1e-12)

    async def _run(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch :]
            live = [(text, future) for text, future in batch if not future.done()]
            if not live:
                continue
            try:
                loop = asyncio.get_running_loop()
                vectors = await loop.run_in_executor(self._thread(), self._compute, [text for text, _ in live])
            except Exception as exc:
                logger.warning("the L3 embedder failed on %d texts: %s", len(live), exc)
                for _, future in live:
                    if not future.done():
                        future.set_exception(exc)
                continue
            self.batches += 1
            for (_, future), vector in zip(live, vectors, strict=True):
                if not future.done():
                    future.set_result(vector)


class Embedders:
    """One ``BatchingEmbedder`` per distinct embedder of the models with L3: ``for_model`` finds a model's."""

    def __init__(self, specs: Mapping[str, ModelSpec], load: Callable[[str], TextModel], threads: int = 1) -> None:
        self._of_model = {model: spec.cache_embedder for model, spec in specs.items()}
        names = dict.fromkeys(self._of_model.values())
        self.by_name = {name: _bind(load, name, threads) for name in names}

    def for_model(self, model: str) -> BatchingEmbedder:
        return self.by_name[self._of_model[model]]

    @property
    def ready(self) -> bool:
        return all(embedder.ready for embedder in self.by_name.values())

    async def warm(self) -> None:
        """Load every embedder now (each in a thread, one after the other), so no first lookup waits for one."""
        for embedder in self.by_name.values():
            await embedder.warm()

    def close(self) -> None:
        for embedder in self.by_name.values():
            embedder.close()


def _bind(load: Callable[[str], TextModel], name: str, threads: int) -> BatchingEmbedder:
    return BatchingEmbedder(lambda: load(name), threads=threads)
