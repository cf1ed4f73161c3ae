"""Replicas: one worker computes N batches at once on one handler (``fleet.consumers.replicas``), and every job still
ends exactly once; refused where the handler cannot run them; a torch runtime gives each replica its own tokenizer."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from fleet.brokers import make_broker
from fleet.brokers.base import Broker
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.replicas import check_replicas, model_executor, replica_threads
from fleet.consumers.requests import Job
from fleet.consumers.runtimes import runtime_handler
from fleet.consumers.worker import Worker
from fleet.errors import ConfigError
from fleet.schemas.jobs import JobRecord, JobState
from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.base import ResultStore
from tests.handlers_for_tests import Items, Overlapping
from tests.infra import connected_pair, eventually, publish_requests, settings_for, wait_terminal
from tests.tiny_models import add_entry

PAIRS = ["memory", "nats+redis"]


@pytest.fixture(params=PAIRS)
def settings(request: pytest.FixtureRequest) -> FleetSettings:
    urls = {kind: request.getfixturevalue(f"{kind}_url") for kind in request.param.split("+") if kind != "memory"}
    return settings_for(request.param, urls)


@pytest.fixture
async def infra(settings: FleetSettings) -> AsyncIterator[tuple[Broker, ResultStore]]:
    async with connected_pair(settings) as pair:
        yield pair


def overlapping(infra: tuple[Broker, ResultStore], settings: FleetSettings, model: str, **kw: object) -> Worker:
    broker, store = infra
    return Worker(with_name(Overlapping, model)(), broker, store, settings=settings, **kw)  # type: ignore[arg-type]


async def test_replicas_compute_batches_at_once_and_every_job_ends_once(infra, settings, unique) -> None:
    broker, store = infra
    model = f"replicas-{unique}"
    await broker.ensure_model(model)
    ids = await publish_requests(broker, model, [{"value": i, "sleep_ms": 150} for i in range(24)], unique)
    settled: collections.Counter[str] = collections.Counter()

    async def count(job: Job, record: JobRecord, won: bool) -> None:
        settled[record.job_id] += won

    started = time.monotonic()
    async with overlapping(infra, settings, model, replicas=4, max_batch=2, on_settled=[count]) as worker:
        records = await wait_terminal(store, ids, timeout_s=30)
        await eventually(lambda: _none_held(worker), what="every message settled")
        beat = worker.heartbeat()
    elapsed = time.monotonic() - started
    handler = worker.handler
    assert {r.state for r in records.values()} == {JobState.succeeded}
    assert [records[j].output["value"] for j in ids] == [2 * i for i in range(24)]
    assert all(r.deliveries == 1 for r in records.values())
    assert sorted(handler.predicted) == list(range(24)), "each job computed exactly once"
    assert settled == dict.fromkeys(ids, 1), "exactly one terminal record per job, written by this worker"
    assert handler.peak == 4, f"4 replicas must compute 4 batches at once (peak {handler.peak})"
    assert len(handler.threads) == 4
    assert len(handler.started_threads) == 4 and set(handler.started_threads) == {replica_threads(4)}
    assert beat.replicas == 4
    serial_s = sum(max(len(call), 1) * 0.15 for call in handler.calls)
    assert elapsed < serial_s * 0.6, f"{elapsed:.2f}s for {serial_s:.2f}s of sleeps: the batches did not overlap"


async def _none_held(worker: Worker) -> bool:
    return len(worker.held) == 0


async def test_one_replica_computes_one_batch_at_a_time(infra, settings, unique) -> None:
    broker, store = infra
    model = f"replicas-{unique}"
    ids = await publish_requests(broker, model, [{"value": i, "sleep_ms": 20} for i in range(12)], unique)
    async with overlapping(infra, settings, model, max_batch=2) as worker:
        await wait_terminal(store, ids, timeout_s=30)
    assert worker.handler.peak == 1 and worker.handler.started_threads == []
    assert worker.heartbeat().replicas == 1


async def test_a_drain_with_replicas_finishes_what_computes_and_hands_back_the_rest(infra, settings, unique) -> None:
    broker, store = infra
    model = f"replicas-{unique}"
    await broker.ensure_model(model)
    ids = await publish_requests(broker, model, [{"value": i, "sleep_ms": 300} for i in range(20)], unique)
    first = overlapping(infra, settings, model, replicas=3, max_batch=1)
    await first.start()
    await eventually(lambda: _running(first, 3), what="3 replicas computing")
    await first.stop()
    done_by_first = list(first.handler.predicted)
    assert len(done_by_first) >= 3
    async with overlapping(infra, settings, model, replicas=4, max_batch=2) as second:
        records = await wait_terminal(store, ids, timeout_s=30)
    assert {r.state for r in records.values()} == {JobState.succeeded}
    assert sorted(done_by_first + second.handler.predicted) == list(range(20)), "each job computed exactly once"
    assert {records[ids[i]].worker_id for i in done_by_first} == {first.worker_id}


async def _running(worker: Worker, n: int) -> bool:
    return worker.handler.running >= n  # type: ignore[attr-defined, no-any-return]


def test_replicas_are_refused_for_a_handler_not_declared_safe() -> None:
    with pytest.raises(ConfigError, match=r"model 'plain' \(.*\) does not declare replica_safe = True.*replicas 1"):
        check_replicas(with_name(Items, "plain")(), 4)
    with pytest.raises(ConfigError, match="computes inline on the worker's event loop"):
        check_replicas(EchoHandler(), 2)
    with pytest.raises(ConfigError, match="must be 1 to 64, got 65"):
        check_replicas(with_name(Overlapping, "many")(), 65)
    check_replicas(with_name(Items, "plain")(), 1)  # one replica: any handler


def test_a_worker_is_not_built_with_replicas_its_handler_cannot_run() -> None:
    settings = FleetSettings()
    with pytest.raises(ConfigError, match="does not declare replica_safe"):
        Worker(with_name(Items, "plain")(), make_broker(settings), make_store(settings), settings=settings, replicas=3)


def test_the_replicas_setting_leaves_a_model_that_cannot_run_them_at_one() -> None:
    """FLEET_REPLICAS covers every model of a process (fleet up serves echo beside embed)."""
    settings = FleetSettings(replicas=3)
    broker, store = make_broker(settings), make_store(settings)
    assert Worker(EchoHandler(), broker, store, settings=settings).replicas == 1
    assert Worker(with_name(Overlapping, "safe")(), broker, store, settings=settings).replicas == 3


def test_replica_threads_share_the_cores() -> None:
    assert replica_threads(8, cores=2) == 1
    assert replica_threads(4, cores=16) == 4
    assert replica_threads(3, cores=16) == 5
    assert replica_threads(1, cores=16) == 16


@pytest.fixture(scope="module")
def tiny_embedder(tmp_path_factory: pytest.TempPathFactory) -> type:
    repo: Path = tmp_path_factory.mktemp("repo")
    return runtime_handler(add_entry(repo, "tiny-embed", "embeddings"))


def test_each_replica_of_a_runtime_has_its_own_tokenizer_and_computes_the_same(tiny_embedder) -> None:
    handler = tiny_embedder(device="cpu")
    handler.load()
    texts = [f"the quick brown fox {'jumps over ' * (i % 7)} the lazy dog {i}" for i in range(48)]
    batch = [handler.parse_input({"texts": texts[i : i + 6]}) for i in range(0, 48, 6)]
    serial = [out.embeddings for out in handler.run(batch)]
    seen: dict[str, int] = {}
    lock = threading.Lock()
    barrier = threading.Barrier(4)

    def one(_: int) -> list[np.ndarray]:
        barrier.wait()  # all four replicas tokenise and compute at the same time
        with lock:
            seen[threading.current_thread().name] = id(handler.thread_tokenizer())
        return [np.asarray(out.embeddings) for _ in range(5) for out in handler.run(batch)][-len(batch) :]

    executor = model_executor(handler, 4, "tiny")
    try:
        results = list(executor.map(one, range(4)))
    finally:
        executor.shutdown(wait=True)
    assert len(seen) == 4 and len(set(seen.values())) == 4, "each replica thread must have its own tokenizer"
    assert id(handler.tokenizer) not in seen.values()
    for outputs in results:
        for got, want in zip(outputs, serial, strict=True):
            np.testing.assert_allclose(got, np.asarray(want), atol=1e-5)


def test_replica_threads_set_their_torch_threads_and_a_model_thread_started_later_keeps_the_processs(
    tiny_embedder,
) -> None:
    """``fleet up`` runs several workers in one process: one model's replica share must not become the torch
    thread count of another worker's model thread started after it."""
    import torch

    handler = tiny_embedder(device="cpu")
    handler.load()
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the process's count: two, so that a leaked share of one shows
    try:
        executor = model_executor(handler, 64, "tiny")  # 64 replicas: one torch thread each on any machine here
        try:
            in_replica_thread = executor.submit(torch.get_num_threads).result()
        finally:
            executor.shutdown(wait=True)
        later = ThreadPoolExecutor(max_workers=1)  # the next worker's model thread
        try:
            in_a_later_thread = later.submit(torch.get_num_threads).result()
        finally:
            later.shutdown(wait=True)
    finally:
        torch.set_num_threads(before)
    assert in_replica_thread == replica_threads(64) == 1
    assert in_a_later_thread == 2


def test_a_tokenizer_copy_follows_a_reload(tiny_embedder) -> None:
    handler = tiny_embedder(device="cpu")
    handler.load()

    def in_a_replica() -> tuple[int, int, int]:
        before = id(handler.thread_tokenizer())
        handler.load()  # a model pool may load the handler again
        return before, id(handler.thread_tokenizer()), id(handler.thread_tokenizer())

    executor = model_executor(handler, 2, "tiny")
    try:
        before, after, same = executor.submit(in_a_replica).result()
    finally:
        executor.shutdown(wait=True)
    assert before != after == same and after != id(handler.tokenizer)
    assert id(handler.thread_tokenizer()) == id(handler.tokenizer)  # a thread that is no replica uses the loaded one


def test_a_handler_not_built_with_the_executor_copies_its_tokenizer_in_a_replica_thread(tiny_embedder) -> None:
    """A model pool's handler is not the one the executor started the replicas with: it copies all the same."""
    first, pooled = tiny_embedder(device="cpu"), tiny_embedder(device="cpu")
    first.load()
    pooled.load()
    executor = model_executor(first, 2, "tiny")
    try:
        copy_id = executor.submit(lambda: id(pooled.thread_tokenizer())).result()
    finally:
        executor.shutdown(wait=True)
    assert copy_id != id(pooled.tokenizer)


async def test_replicas_of_a_tiny_runtime_serve_end_to_end(tiny_embedder, unique) -> None:
    settings = settings_for("memory", {})
    async with connected_pair(settings) as (broker, store):
        model = tiny_embedder.spec.name
        inputs = [{"texts": [f"the cat sat on the mat {i}", "a quick brown fox " * (i % 5 + 1)]} for i in range(40)]
        ids = await publish_requests(broker, model, inputs, unique)
        handler = tiny_embedder(device="cpu")
        async with Worker(handler, broker, store, settings=settings, replicas=4, max_batch=4):
            records = await wait_terminal(store, ids, timeout_s=60)
    assert {r.state for r in records.values()} == {JobState.succeeded}
    assert all(len(r.output["embeddings"]) == 2 and r.output["dim"] == 32 for r in records.values())
