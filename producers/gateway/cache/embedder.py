"""The gateway's text embedder for the L3 cache: concurrent lookups batched into one forward pass, off the loop.

The model is the ``embed`` handler's (all-MiniLM-L6-v2, ``fleet.consumers.handlers.embed``), resolved by import path
(``fleet.models.import_object``) so that the gateway does not import the worker package, and loaded in a worker
thread on first use, on the device the worker would choose (``settings.device``). ``BatchingEmbedder.embed``
queues a text; one drain task takes whatever is queued (up to ``max_batch``), runs the model in a thread, and
answers every caller of that batch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Protocol

import numpy as np

from fleet.models import import_object

logger = logging.getLogger(__name__)

EMBED_HANDLER = "fleet.consumers.handlers.embed:EmbedHandler"


class TextModel(Protocol):
    """What the embedder needs of a model: unit vectors for texts (``EmbedHandler.embed_texts``)."""

    def embed_texts(self, texts: list[str]) -> list[list[float]]: ...


def load_embed_handler(device: str, path: str = EMBED_HANDLER) -> TextModel:
    """Build and load the handler at ``path`` on ``device`` (blocking: call it in a thread)."""
    handler = import_object(path)(device=device)
    handler.load()
    model: TextModel = handler
    return model


class BatchingEmbedder:
    """``await embed(text)`` -> a float32 unit vector; concurrent calls share one model call."""

    def __init__(self, load: Callable[[], TextModel], *, max_batch: int = 64) -> None:
        self._load = load
        self._max_batch = max_batch
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
                vectors = await asyncio.to_thread(self._compute, [text for text, _ in live])
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
