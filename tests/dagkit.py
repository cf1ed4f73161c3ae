"""What the DAG end-to-end tests share: real workers continuing runs, and counters of what reached the store.

``dag_fleet`` starts ``workers`` in-process ``Worker``s of one ``Steps`` model (``tests.handlers_for_tests``) with
the runner's settle hook, over a real broker/store pair. ``CountingStore`` counts the terminal writes that won per
job id (the worker's and the runner's cancels alike), ``RecordingDagStore`` keeps every change of every run
document, so a test can say "terminal exactly once", "launched once", "failed once".
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fleet import constants as c
from fleet.brokers.base import Broker
from fleet.consumers.handlers import with_name
from fleet.consumers.worker import Worker
from fleet.dags.runner import DagRunner
from fleet.dags.state import job_id
from fleet.schemas.jobs import JobRecord
from fleet.settings import FleetSettings
from fleet.store.base import Finish, ResultStore
from fleet.store.bundle import Stores
from fleet.store.dagstore import DagStore, RunDoc
from tests.handlers_for_tests import Steps
from tests.infra import count_completions, drain_subject, eventually


class CountingStore:
    """A ``ResultStore`` that counts, per job id, the terminal writes that won (first terminal write)."""

    def __init__(self, inner: ResultStore) -> None:
        self._inner = inner
        self.won: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def finish(self, job_id: str, state: Any, **kw: Any) -> tuple[bool, JobRecord]:
        won, record = await self._inner.finish(job_id, state, **kw)
        if won:
            self.won[job_id] += 1
        return won, record

    async def finish_many(self, items: list[Finish]) -> list[tuple[bool, JobRecord]]:
        results = await self._inner.finish_many(items)
        for won, record in results:
            if won:
                self.won[record.job_id] += 1
        return results


class RecordingDagStore:
    """A ``DagStore`` that keeps every ``(before, after)`` of ``update_run`` that changed a run."""

    def __init__(self, inner: DagStore) -> None:
        self._inner = inner
        self.changes: list[tuple[RunDoc, RunDoc]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def update_run(self, run_id: str, change: Callable[[RunDoc], RunDoc | None]) -> tuple[RunDoc, RunDoc]:
        before, after = await self._inner.update_run(run_id, change)
        if before != after:
            self.changes.append((before, after))
        return before, after

    def of(self, run_id: str) -> list[tuple[RunDoc, RunDoc]]:
        return [(b, a) for b, a in self.changes if a["run"]["run_id"] == run_id]


@dataclass
class DagFleet:
    runner: DagRunner
    broker: Broker
    store: CountingStore
    dags: RecordingDagStore
    model: str
    workers: list[Worker]
    completions: collections.Counter[str] | None = None  # Redis done notifications per job id (Redis stores only)
    settled: collections.Counter[str] = field(default_factory=collections.Counter)  # settle-hook calls per job id

    async def run(self, spec: dict[str, Any], run_input: Any, timeout_s: float = 30, **start: Any) -> dict[str, Any]:
        """Register ``spec``, start a run, wait until it is over; its view."""
        name, _, _ = await self.runner.register(spec)
        _, doc = await self.runner.start(name, run_input, **start)
        run_id = doc["run"]["run_id"]
        doc = await self.runner.wait(run_id, timeout_s)
        assert doc.get("finished_at") is not None, f"run {run_id} not over after {timeout_s}s: {doc}"
        return await self.runner.view(run_id)

    async def ids(self, run_id: str) -> Callable[[str, int], str]:
        """``jid(step, index)``: the job ids of a run's steps (they carry the run's key, from its document)."""
        doc = await self.runner.get(run_id)
        return lambda step, index: job_id(run_id, step, index, doc.get("key"))

    async def dead_letters(self, unique: str) -> list[str]:
        letters = await drain_subject(self.broker, c.dlq_subject(self.model), f"dlq-{unique}")
        import json

        return [json.loads(d.data)["job_id"] for d in letters]

    def runs_of(self, key: str) -> int:
        return Steps.runs.get(key, 0)


@contextlib.asynccontextmanager
async def dag_fleet(
    broker: Broker, store: ResultStore, settings: FleetSettings, unique: str, workers: int = 2
) -> AsyncIterator[DagFleet]:
    model = f"steps-{unique}"
    handler_cls = with_name(Steps, model)
    counting = CountingStore(store)
    dags = RecordingDagStore(Stores.beside(store).dags)
    runner = DagRunner(broker, counting, dags, {model: handler_cls.spec})  # type: ignore[arg-type]
    settled: collections.Counter[str] = collections.Counter()

    async def count(job: Any, record: JobRecord, won: bool) -> None:
        settled[record.job_id] += 1

    pool = [
        Worker(handler_cls(), broker, counting, settings=settings, on_settled=[runner.on_settled, count])  # type: ignore[arg-type]
        for _ in range(workers)
    ]
    completions: collections.Counter[str] | None = None
    listener: asyncio.Task[None] | None = None
    if store.scheme == "redis":
        completions = collections.Counter()
        ready = asyncio.Event()
        listener = asyncio.create_task(count_completions(settings.store_url, ready, completions))
        await ready.wait()
    async with contextlib.AsyncExitStack() as stack:
        for worker in pool:
            await stack.enter_async_context(worker)
        try:
            yield DagFleet(runner, broker, counting, dags, model, pool, completions, settled)
        finally:
            if listener is not None:
                listener.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await listener


async def terminal_once(fleet: DagFleet, job_ids: list[str]) -> None:
    """Every job has exactly one winning terminal write, and (on Redis) exactly one done notification."""
    assert {j: fleet.store.won[j] for j in job_ids} == dict.fromkeys(job_ids, 1)
    if fleet.completions is not None:
        counts = fleet.completions

        async def all_notified() -> bool:
            return all(counts[j] >= 1 for j in job_ids)

        await eventually(all_notified, 5, "a done notification for every job")
        await asyncio.sleep(0.2)  # a second notification would come right behind the first
        assert {j: fleet.completions[j] for j in job_ids} == dict.fromkeys(job_ids, 1)


def all_job_ids(view: dict[str, Any]) -> list[str]:
    return [j for step in view["steps"].values() for j in step["job_ids"]]
