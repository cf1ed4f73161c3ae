"""Rolling worker statistics for heartbeats and metrics."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list; 0.0 for an empty one."""
    if not sorted_values:
        return 0.0
    rank = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[rank]


@dataclass(slots=True)
class WorkerStats:
    """Counts and latencies of the batches one worker ran. ``latencies_ms`` are per batch compute times."""

    window: int = 1024
    ewma_alpha: float = 0.2
    batches: int = 0
    items: int = 0
    failures: int = 0
    latency_ewma_ms: float = 0.0
    latencies_ms: deque[float] = field(default_factory=deque)
    completions: deque[tuple[float, int]] = field(default_factory=deque)

    def record_batch(self, size: int, compute_ms: float, now: float | None = None) -> None:
        self.batches += 1
        self.items += size
        self.latency_ewma_ms = (
            compute_ms
            if self.batches == 1
            else self.ewma_alpha * compute_ms + (1 - self.ewma_alpha) * self.latency_ewma_ms
        )
        self.latencies_ms.append(compute_ms)
        if len(self.latencies_ms) > self.window:
            self.latencies_ms.popleft()
        self.completions.append((now if now is not None else time.monotonic(), size))

    def throughput_per_s(self, horizon_s: float = 10.0, now: float | None = None) -> float:
        now = now if now is not None else time.monotonic()
        while self.completions and self.completions[0][0] < now - horizon_s:
            self.completions.popleft()
        return sum(n for _, n in self.completions) / horizon_s

    def snapshot(self) -> dict[str, float | int]:
        ordered = sorted(self.latencies_ms)
        return {
            "batches": self.batches,
            "items": self.items,
            "failures": self.failures,
            "mean_batch_size": self.items / self.batches if self.batches else 0.0,
            "latency_ewma_ms": self.latency_ewma_ms,
            "latency_p50_ms": percentile(ordered, 0.50),
            "latency_p99_ms": percentile(ordered, 0.99),
            "throughput_per_s": self.throughput_per_s(),
        }
