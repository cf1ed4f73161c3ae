"""What a worker's devices hold: each GPU's utilisation and memory (NVML), and each loaded model version's bytes.

NVML (``pynvml``, from the ``nvidia-ml-py`` package of the ``models`` extra) is initialised once, on the first
sample. On a machine without a GPU (no driver: ``NVMLError`` at init) or without the package, ``GpuSampler``
reports nothing: an empty list, never an exception, and one DEBUG line for the whole process life. NVML sees every
device of the machine (or of the container), whatever ``CUDA_VISIBLE_DEVICES`` says.

Model memory is the bytes of the parameters and buffers a loaded handler's torch modules keep on a CUDA device
(the weights, counted once per tensor): torch is never imported here (a module is recognised by its
``parameters``/``buffers`` methods, a CUDA tensor by ``is_cuda``), so a CPU worker of ``echo`` stays light, and a CPU
model reports nothing. A handler is measured once per load, not per sample.

The worker samples on its heartbeat interval (never per batch) and puts the result in its heartbeats
(``Heartbeat.gpus``, ``Heartbeat.model_memory_bytes``) and in the gauges of ``fleet.consumers.metrics``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from fleet.consumers import metrics
from fleet.schemas.wire import GpuStats

log = logging.getLogger(__name__)


class GpuSampler:
    """Reads every device through NVML; an empty list where there is no GPU or no NVML."""

    def __init__(self) -> None:
        self._nvml: ModuleType | None = None
        self._tried = False
        self._told = False  # the one DEBUG line said why there is nothing

    def sample(self) -> list[GpuStats]:
        nvml = self._init()
        if nvml is None:
            return []
        try:
            return [_device(nvml, index) for index in range(nvml.nvmlDeviceGetCount())]
        except Exception as exc:  # a device fell off the bus, the driver went away: nothing this time
            self._tell("GPU statistics not read: %s", exc)
            return []

    def _init(self) -> ModuleType | None:
        if not self._tried:
            self._tried = True
            try:
                nvml = importlib.import_module("pynvml")
                nvml.nvmlInit()
            except Exception as exc:  # ImportError, or NVMLError: no driver, no device
                self._tell("no GPU statistics on this machine: %s", exc)
            else:
                self._nvml = nvml
        return self._nvml

    def _tell(self, message: str, exc: BaseException) -> None:
        if not self._told:
            self._told = True
            log.debug(message, exc)


def _device(nvml: Any, index: int) -> GpuStats:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    return GpuStats(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(handle)),
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        utilization_pct=float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
        memory_used_bytes=int(memory.used),
        memory_total_bytes=int(memory.total),
    )


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value  # older nvidia-ml-py answers bytes


def cuda_bytes(handler: object) -> int | None:
    """Bytes of the parameters and buffers on a CUDA device of the torch modules among ``handler``'s attributes
    (each tensor once); None when it keeps none there (a CPU model, a model without torch)."""
    seen: set[int] = set()
    total = 0
    for value in getattr(handler, "__dict__", {}).values():
        parameters, buffers = getattr(value, "parameters", None), getattr(value, "buffers", None)
        if not (callable(parameters) and callable(buffers) and hasattr(value, "state_dict")):
            continue
        for tensor in (*parameters(), *buffers()):
            if not getattr(tensor, "is_cuda", False) or tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total or None


def _measure(handler: object) -> int | None:
    try:
        return cuda_bytes(handler)
    except Exception as exc:  # a handler's odd attribute: its memory goes unreported, the worker goes on
        log.debug("model memory of %r not measured: %s", handler, exc)
        return None


class ModelMemory:
    """The device bytes of each loaded version of one model, measured once per loaded handler."""

    def __init__(self) -> None:
        self._measured: dict[str, tuple[int, int | None]] = {}  # version -> (id of its handler, bytes)

    def sample(self, handlers: Mapping[str, object]) -> dict[str, int]:
        measured = {}
        for version, handler in handlers.items():
            known = self._measured.get(version)
            if known is None or known[0] != id(handler):
                known = (id(handler), _measure(handler))
            measured[version] = known
        self._measured = measured
        return {version: size for version, (_, size) in measured.items() if size is not None}


class DeviceGauges:
    """Keeps the GPU and model-memory gauges of one worker equal to its latest sample (gone series removed)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._versions: set[str] = set()

    def export(self, gpus: list[GpuStats], model_memory: dict[str, int]) -> None:
        for gpu in gpus:
            labels = (str(gpu.index), gpu.uuid or "")
            metrics.GPU_UTILIZATION.labels(*labels).set(gpu.utilization_pct / 100)
            metrics.GPU_MEMORY_USED.labels(*labels).set(gpu.memory_used_bytes)
            metrics.GPU_MEMORY_TOTAL.labels(*labels).set(gpu.memory_total_bytes)
        for version, size in model_memory.items():
            metrics.MODEL_MEMORY.labels(self.model, version).set(size)
        for version in self._versions - set(model_memory):
            metrics.MODEL_MEMORY.remove(self.model, version)
        self._versions = set(model_memory)

    def clear(self) -> None:
        """Remove this worker's model-memory series (at stop); the device series belong to the process."""
        self.export([], {})


SAMPLER = GpuSampler()  # one per process: NVML is initialised once
