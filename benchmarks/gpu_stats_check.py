"""Does the worker's GPU reading work on a real GPU? NVML through ``fleet.consumers.gpu_stats`` and the device
memory of a model loaded on CUDA, checked against torch's own figures.

1. ``GpuSampler`` lists every device torch sees, each with a name, a UUID, a utilisation in [0, 100] and a total
   memory within 1% of ``torch.cuda.get_device_properties(i).total_memory``;
2. ``cuda_bytes`` of a handler holding ``embed``'s model on CUDA equals the parameter and buffer bytes torch
   counts, and is about what ``torch.cuda.memory_allocated`` grew by when the model moved to the device.

Exits 1 on the first disagreement. Run by ``scripts/bench_gpu.sh``:

    python -m benchmarks.gpu_stats_check
"""

from __future__ import annotations

import sys
import types

import torch

from fleet.consumers.gpu_stats import GpuSampler, cuda_bytes


def fail(message: str) -> None:
    sys.exit(f"gpu stats check FAILED: {message}")


def check_devices() -> None:
    gpus = GpuSampler().sample()
    print("gpus:", [g.model_dump() for g in gpus])
    if len(gpus) < torch.cuda.device_count():
        fail(f"NVML lists {len(gpus)} devices, torch sees {torch.cuda.device_count()}")
    totals = sorted(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    for gpu in gpus:
        if not (gpu.name and gpu.uuid and 0 <= gpu.utilization_pct <= 100 and gpu.memory_used_bytes > 0):
            fail(f"device {gpu.index} reads {gpu}")
    if not any(abs(g.memory_total_bytes - t) <= 0.01 * t for g in gpus for t in totals):
        fail(f"no NVML total near torch's {totals}")


def check_model_memory() -> None:
    before = torch.cuda.memory_allocated()
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.LayerNorm(4096)).half().cuda()
    model.register_buffer("scale", torch.ones(4096, dtype=torch.half, device="cuda"))
    grown = torch.cuda.memory_allocated() - before
    expected = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    measured = cuda_bytes(types.SimpleNamespace(model=model))
    print(f"model memory: cuda_bytes {measured}, parameters+buffers {expected}, allocated grew {grown}")
    if measured != expected:
        fail(f"cuda_bytes {measured} != {expected}")
    if not expected <= grown <= expected + 2 * 1024**2:  # the allocator rounds each tensor up (512-byte blocks)
        fail(f"torch allocated {grown} bytes for {expected} bytes of tensors")
    if cuda_bytes(types.SimpleNamespace(model=model.cpu())) is not None:
        fail("a model moved back to the CPU still counts device memory")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        fail("no CUDA device is visible")
    check_devices()
    check_model_memory()
    print("gpu stats check passed")
