"""``inprocess``: workers as objects in this process, for the embedded in-memory broker that processes cannot share.

The composition root passes a factory that builds and starts a worker for a model; this module never imports the
worker itself (components do not import each other), only the ``stop()`` it needs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from fleet.autoscaler.backends.base import check_replicas
from fleet.errors import ScalerError

log = logging.getLogger(__name__)


class Stoppable(Protocol):
    """A started worker. ``stop`` drains: finish the batch in flight, hand unfinished messages back."""

    async def stop(self) -> None: ...


STOPPED_STATES = ("draining", "stopped")  # a worker's ``state`` once it stops (read when it has one)
StartWorker = Callable[[str], Awaitable[Stoppable]]


class InProcessBackend:
    """Starts and stops workers inside this process through ``start_worker``.

    Args:
        start_worker: ``await start_worker(model)`` returns a started worker for ``model``.

    Scale-in stops the newest workers first; their drain runs in the background and is not counted as a replica.
    A worker that stops on its own (its ``state`` says draining or stopped: an operator drained it) is forgotten.
    ``close`` drains every worker this backend started.
    """

    name = "inprocess"

    def __init__(self, start_worker: StartWorker) -> None:
        self._start_worker = start_worker
        self._workers: dict[str, list[Stoppable]] = {}
        self._draining: set[asyncio.Task[None]] = set()
        self._lock = asyncio.Lock()
        self._closed = False

    async def current_replicas(self, model: str) -> int:
        return len(self._live(model))

    def _live(self, model: str) -> list[Stoppable]:
        """The model's workers, forgetting those that stopped on their own (an operator's drain request)."""
        workers = self._workers.setdefault(model, [])
        gone = [w for w in workers if getattr(w, "state", None) in STOPPED_STATES]
        for worker in gone:
            workers.remove(worker)
            log.info("inprocess: a worker of %s stopped on its own; it is no longer counted", model)
        return workers

    def draining(self) -> int:
        """How many stopped workers are still draining."""
        return sum(1 for task in self._draining if not task.done())

    async def set_replicas(self, model: str, replicas: int) -> None:
        check_replicas(model, replicas)
        async with self._lock:
            if self._closed:
                raise ScalerError("the inprocess backend is closed", backend=self.name, target=model, retriable=False)
            workers = self._live(model)
            if replicas > len(workers):
                await self._start(model, workers, replicas - len(workers))
            while len(workers) > replicas:
                self._drain(model, workers.pop())

    async def _start(self, model: str, workers: list[Stoppable], count: int) -> None:
        """Start ``count`` workers at once; keep the ones that started even if another failed."""
        results = await asyncio.gather(*(self._start_worker(model) for _ in range(count)), return_exceptions=True)
        started = [r for r in results if not isinstance(r, BaseException)]
        workers.extend(started)
        log.info("inprocess: %s now has %d workers (+%d)", model, len(workers), len(started))
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise ScalerError(
                f"{len(errors)} of {count} workers for model {model!r} failed to start: {errors[0]!r}",
                backend=self.name,
                target=model,
            ) from errors[0]

    def _drain(self, model: str, worker: Stoppable) -> None:
        task = asyncio.create_task(self._stop(model, worker), name=f"inprocess-drain-{model}")
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    @staticmethod
    async def _stop(model: str, worker: Stoppable) -> None:
        try:
            await worker.stop()
        except Exception:
            log.exception("inprocess: a worker of %s failed while draining", model)
        else:
            log.info("inprocess: a worker of %s drained and stopped", model)

    async def close(self) -> None:
        """Drain every worker (idempotent)."""
        async with self._lock:
            self._closed = True
            for model, workers in self._workers.items():
                while workers:
                    self._drain(model, workers.pop())
        await asyncio.gather(*list(self._draining), return_exceptions=True)
