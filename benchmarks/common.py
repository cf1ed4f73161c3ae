"""Shared pieces of the benchmarks: services, timing, result files. Benchmarks print ratios measured side by side
in one run; they are never timed tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks import envelope

RESULTS_DIR = Path(__file__).resolve().parent / "results"
console = Console()
# The machine as the run found it: a benchmark imports this module first thing.
STARTED = envelope.now_iso()
LOAD_AT_START = envelope.load_average()
SHOWN: list[envelope.Table] = []


@contextlib.contextmanager
def services(nats: bool = True, redis: bool = True, kafka: bool = False) -> Iterator[dict[str, str]]:
    """NATS, Redis and Kafka from FLEET_BENCH_NATS_URL / FLEET_BENCH_REDIS_URL / FLEET_BENCH_KAFKA_URL, else started
    locally like the tests do (Kafka: a single KRaft node, see ``tests/kafka_service.py``)."""
    from tests import services as svc
    from tests.kafka_service import kafka_server

    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}
        if nats:
            urls["nats"] = os.environ.get("FLEET_BENCH_NATS_URL") or stack.enter_context(svc.nats_server())
        if redis:
            urls["redis"] = os.environ.get("FLEET_BENCH_REDIS_URL") or stack.enter_context(svc.redis_server())
        if kafka:
            urls["kafka"] = os.environ.get("FLEET_BENCH_KAFKA_URL") or stack.enter_context(kafka_server())
        yield urls


def stop_processes(procs: list[subprocess.Popen[bytes]], timeout_s: float = 30) -> None:
    """SIGTERM every running process (fleet processes drain on it), wait, and SIGKILL what outlives the wait."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()


async def pooled(items: list[Any], concurrency: int, send: Callable[[Any], Awaitable[None]]) -> None:
    """Await ``send`` for every item with ``concurrency`` in flight: the pattern ``publish_all`` uses, so the raw
    baselines and the fleet pay the same client-side cost for keeping publishes in flight."""
    pending = iter(items)

    async def worker() -> None:
        for item in pending:
            await send(item)

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(items))))))


def percentiles_ms(values_s: list[float]) -> dict[str, float]:
    ordered = sorted(values_s)

    def pct(q: float) -> float:
        return 1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"p50_ms": pct(0.50), "p90_ms": pct(0.90), "p99_ms": pct(0.99), "mean_ms": 1000 * statistics.fmean(ordered)}


def best_of(runs: list[float]) -> float:
    """Throughputs are noisy on shared machines; report the best of a few interleaved runs of each side."""
    return max(runs)


def paired_median(numerators: list[float], denominators: list[float]) -> float:
    """The median of the per-round ratios ``numerators[i] / denominators[i]`` of two sides run back to back.

    On a shared machine a whole round can run slower (another tenant's load): that moves both sides of the round
    alike, so the ratio within a round keeps its meaning where the best (or the median) of each side, taken from
    different rounds, mixes a quiet round with a loud one.
    """
    if not numerators or len(numerators) != len(denominators):
        raise ValueError(f"need as many rounds on each side, got {len(numerators)} and {len(denominators)}")
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


async def fetch_and_ack(psub: Any, n: int, batch: int) -> None:
    """Drain ``n`` messages from a nats-py pull subscription, ``batch`` a fetch, acking each: the raw loops of
    ``bench_pipeline`` and ``bench_compact``."""
    import nats.errors

    done = 0
    while done < n:
        try:
            msgs = await psub.fetch(batch, timeout=1)
        except nats.errors.TimeoutError:
            continue
        for msg in msgs:
            await msg.ack()
        done += len(msgs)


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


def write_result(name: str, figures: dict[str, Any], out: Path | None = None) -> Path:
    """Write ``benchmarks/results/<name>.json`` (or ``out``): the benchmark's ``figures`` inside the shared envelope
    (``benchmarks.envelope``), with the tables this run printed through ``show`` as its headlines."""
    document = envelope.envelope(
        name, figures, list(SHOWN), started=STARTED, load_at_start=LOAD_AT_START, argv=sys.argv
    )
    return envelope.write(out or RESULTS_DIR / f"{name}.json", document)


def record(title: str, rows: list[tuple[str, str, str]]) -> None:
    """Keep a table of (measure, value, target) rows for ``write_result`` without printing it: for benchmarks that
    print their own layout. Rows with a target are the headlines of the benchmarks page."""
    SHOWN.append(envelope.Table(title, [envelope.Row(*(str(cell) for cell in row)) for row in rows]))


def show(title: str, rows: list[tuple[str, str, str]]) -> None:
    """Print a table of (measure, value, target) rows and ``record`` it for the result file."""
    record(title, rows)
    table = Table(title=title)
    for column in ("measure", "value", "target"):
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    console.print(table)
