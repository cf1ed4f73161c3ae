"""GPU and model memory (``fleet.consumers.gpu_stats``): absent without a GPU, mapped into heartbeats and gauges
with one.

This machine has no GPU: the no-GPU path runs for real (NVML's own error at init, or the package missing) through a
real worker on NATS + Redis. The GPU path injects a stand-in ``pynvml`` module into ``sys.modules``: it tests our
mapping of NVML's answers to ``GpuStats``, heartbeats and gauges, not a Fleet seam (the sampler, the worker and the
broker are the real ones). ``scripts/bench_gpu.sh`` checks the real NVML on a GPU machine.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import types
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client import REGISTRY, generate_latest

from fleet import constants as c
from fleet.brokers.base import Broker
from fleet.consumers import metrics
from fleet.consumers.gpu_stats import DeviceGauges, GpuSampler, ModelMemory, cuda_bytes
from fleet.consumers.handlers import with_name
from fleet.consumers.worker import Worker
from fleet.schemas.wire import GpuStats, Heartbeat
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from tests.handlers_for_tests import Items
from tests.infra import connected_pair, eventually, publish_requests, settings_for, wait_terminal

GIB = 1 << 30


# -- a stand-in for pynvml: two devices, counting the calls ------------------------------------------------------


@dataclass
class _Memory:
    used: int
    total: int
    free: int = 0


@dataclass
class _Utilization:
    gpu: int
    memory: int = 0


def fake_nvml(calls: dict[str, int]) -> types.ModuleType:
    """Answers as nvidia-ml-py does (an older one: names and UUIDs as bytes)."""
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    devices = [
        (b"NVIDIA H100 80GB HBM3", b"GPU-aaaa", 37, _Memory(used=3 * GIB, total=80 * GIB)),
        (b"NVIDIA H100 80GB HBM3", b"GPU-bbbb", 0, _Memory(used=GIB // 2, total=80 * GIB)),
    ]

    def count(name: str, answer: Any) -> Any:
        calls[name] = calls.get(name, 0) + 1
        return answer

    nvml.NVMLError = NVMLError  # type: ignore[attr-defined]
    nvml.nvmlInit = lambda: count("init", None)  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetCount = lambda: count("count", len(devices))  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByIndex = lambda i: count("handle", i)  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetName = lambda h: devices[h][0]  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetUUID = lambda h: devices[h][1]  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetUtilizationRates = lambda h: count("utilization", _Utilization(devices[h][2]))  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetMemoryInfo = lambda h: devices[h][3]  # type: ignore[attr-defined]
    return nvml


@pytest.fixture
def nvml_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    calls: dict[str, int] = {}
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(calls))
    yield calls
    for gauge in (metrics.GPU_UTILIZATION, metrics.GPU_MEMORY_USED, metrics.GPU_MEMORY_TOTAL, metrics.MODEL_MEMORY):
        gauge.clear()  # this process has no GPU: leave no series behind for the tests after this one


# -- no GPU: nothing, quietly ---------------------------------------------------------------------------------


def test_without_a_gpu_the_sampler_reports_nothing_and_says_so_once_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="fleet.consumers.gpu_stats")
    sampler = GpuSampler()
    assert [sampler.sample() for _ in range(3)] == [[], [], []]
    records = [r for r in caplog.records if r.name == "fleet.consumers.gpu_stats"]
    assert len(records) == 1 and records[0].levelno == logging.DEBUG, records


def test_without_nvidia_ml_py_the_sampler_reports_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert GpuSampler().sample() == []


def test_a_cpu_model_holds_no_device_memory() -> None:
    import torch  # the models extra's: a real module on the CPU

    handler = types.SimpleNamespace(model=torch.nn.Linear(32, 32), tokenizer=object())
    assert cuda_bytes(handler) is None
    assert ModelMemory().sample({"1": handler}) == {}


# -- with a GPU: the mapping ----------------------------------------------------------------------------------


def test_nvml_answers_map_to_gpu_stats_and_gauges(nvml_calls: dict[str, int]) -> None:
    gpus = GpuSampler().sample()
    assert gpus == [
        GpuStats(
            index=0,
            name="NVIDIA H100 80GB HBM3",
            uuid="GPU-aaaa",
            utilization_pct=37.0,
            memory_used_bytes=3 * GIB,
            memory_total_bytes=80 * GIB,
        ),
        GpuStats(
            index=1,
            name="NVIDIA H100 80GB HBM3",
            uuid="GPU-bbbb",
            utilization_pct=0.0,
            memory_used_bytes=GIB // 2,
            memory_total_bytes=80 * GIB,
        ),
    ]
    gauges = DeviceGauges("embed")
    gauges.export(gpus, {"1": 440 * 1024**2, "2": 1024})
    value = REGISTRY.get_sample_value
    assert value("fleet_gpu_utilization_ratio", {"gpu": "0", "uuid": "GPU-aaaa"}) == 0.37
    assert value("fleet_gpu_memory_used_bytes", {"gpu": "1", "uuid": "GPU-bbbb"}) == GIB // 2
    assert value("fleet_gpu_memory_total_bytes", {"gpu": "1", "uuid": "GPU-bbbb"}) == 80 * GIB
    assert value("fleet_model_memory_bytes", {"model": "embed", "version": "1"}) == 440 * 1024**2
    gauges.export(gpus, {"2": 1024})  # version 1 unloaded: its series goes
    assert value("fleet_model_memory_bytes", {"model": "embed", "version": "1"}) is None
    assert value("fleet_model_memory_bytes", {"model": "embed", "version": "2"}) == 1024


def test_nvml_init_runs_once_and_a_failing_device_read_is_empty_not_an_error(nvml_calls: dict[str, int]) -> None:
    sampler = GpuSampler()
    sampler.sample()
    sampler.sample()
    assert nvml_calls["init"] == 1
    nvml = sys.modules["pynvml"]
    nvml.nvmlDeviceGetCount = lambda: (_ for _ in ()).throw(nvml.NVMLError("GPU is lost"))  # type: ignore[union-attr]
    assert sampler.sample() == []


class _Tensor:
    """A tensor as ``cuda_bytes`` reads it (``is_cuda``, ``data_ptr``, ``numel``, ``element_size``)."""

    def __init__(self, address: int, numel: int, is_cuda: bool = True) -> None:
        self.address, self.count, self.is_cuda = address, numel, is_cuda

    def data_ptr(self) -> int:
        return self.address

    def numel(self) -> int:
        return self.count

    def element_size(self) -> int:
        return 2  # half precision, as on CUDA


class _Module:
    def __init__(self, parameters: list[_Tensor], buffers: list[_Tensor]) -> None:
        self._parameters, self._buffers = parameters, buffers

    def parameters(self) -> list[_Tensor]:
        return self._parameters

    def buffers(self) -> list[_Tensor]:
        return self._buffers

    def state_dict(self) -> dict[str, Any]:
        return {}


def test_model_memory_counts_each_cuda_tensor_once_and_measures_each_load_once() -> None:
    shared = _Tensor(1, 1000)
    model = _Module([shared, _Tensor(2, 500), _Tensor(3, 99, is_cuda=False)], [_Tensor(4, 10), shared])
    handler = types.SimpleNamespace(model=model, head=model)
    assert cuda_bytes(handler) == 2 * (1000 + 500 + 10)
    memory = ModelMemory()
    assert memory.sample({"1": handler}) == {"1": 3020}
    model._parameters.append(_Tensor(5, 1_000_000))  # measured at its load, not again per sample
    assert memory.sample({"1": handler}) == {"1": 3020}
    reloaded = types.SimpleNamespace(model=model)
    assert memory.sample({"1": reloaded}) == {"1": 2 * (1000 + 500 + 10 + 1_000_000)}


# -- a real worker on NATS + Redis ------------------------------------------------------------------------------


@pytest.fixture
async def infra(nats_url: str, redis_url: str) -> AsyncIterator[tuple[Broker, ResultStore, FleetSettings]]:
    settings = settings_for("nats+redis", {"nats": nats_url, "redis": redis_url}, heartbeat_interval_s=0.2)
    async with connected_pair(settings) as (broker, store):
        yield broker, store, settings


async def run_worker(
    infra: tuple[Broker, ResultStore, FleetSettings], unique: str, sampler: GpuSampler
) -> list[Heartbeat]:
    """Run 20 jobs through a worker, one a batch; the heartbeats it sent."""
    broker, store, settings = infra
    model = f"items-{unique}"
    events = await broker.listen(c.heartbeat_subject(model))
    seen: list[Heartbeat] = []

    async def collect() -> None:
        async for _subject, data in events:
            seen.append(Heartbeat.model_validate_json(data))

    task = asyncio.create_task(collect())
    try:
        ids = await publish_requests(broker, model, [{"value": i} for i in range(20)], unique)
        worker = Worker(with_name(Items, model)(), broker, store, settings=settings, max_batch=1)
        worker.devices = sampler
        async with worker:
            await wait_terminal(store, ids)

            async def beats() -> bool:
                return sum(h.items == 20 for h in seen) >= 2

            await eventually(beats, what="two heartbeats after the jobs")
    finally:
        task.cancel()
        await events.close()
    return seen


async def test_a_worker_without_a_gpu_sends_empty_lists_and_exports_no_gpu_series(infra, unique) -> None:
    seen = await run_worker(infra, unique, GpuSampler())
    assert seen and all(h.gpus == [] and h.model_memory_bytes == {} for h in seen)
    series = [line for line in generate_latest(REGISTRY).decode().splitlines() if not line.startswith("#")]
    assert [line for line in series if line.startswith(("fleet_gpu_", "fleet_model_memory_bytes"))] == []


async def test_a_worker_with_a_gpu_reports_it_in_heartbeats_sampled_per_heartbeat_not_per_batch(
    infra, unique, nvml_calls: dict[str, int]
) -> None:
    seen = await run_worker(infra, unique, GpuSampler())
    ready = [h for h in seen if h.state == "ready"]
    assert ready and all([g.uuid for g in h.gpus] == ["GPU-aaaa", "GPU-bbbb"] for h in ready)
    assert ready[-1].gpus[0].utilization_pct == 37.0 and ready[-1].gpus[0].memory_total_bytes == 80 * GIB
    # one sample (two devices) per heartbeat, not per batch: 20 batches of one (40 reads per batch), a few beats
    assert nvml_calls["utilization"] <= 2 * (len(seen) + 2), (nvml_calls, len(seen))
    assert REGISTRY.get_sample_value("fleet_gpu_utilization_ratio", {"gpu": "0", "uuid": "GPU-aaaa"}) == 0.37


async def test_a_worker_exports_its_slo_targets_and_job_latencies(infra, unique) -> None:
    broker, store, settings = infra
    settings = settings.model_copy(update={"slo_latency_s": 2.5, "slo_latency_target": 0.95, "slo_error_target": 0.99})
    model = f"items-{unique}"
    ids = await publish_requests(broker, model, [{"value": i} for i in range(5)], unique)
    async with Worker(with_name(Items, model)(), broker, store, settings=settings):
        await wait_terminal(store, ids)
    value = REGISTRY.get_sample_value
    assert value("fleet_slo_latency_objective", {"model": model, "le": "2.5"}) == 0.95
    assert value("fleet_slo_error_objective", {"model": model}) == 0.99
    assert value("fleet_job_latency_seconds_count", {"model": model}) == 5
    assert value("fleet_job_latency_seconds_bucket", {"model": model, "le": "600.0"}) == 5
