"""`embed` served by N real `fleet worker` processes sharing one device, over NATS + Redis, against the bare loop.

    python -m benchmarks.bench_embed_fleet [--device auto|cpu|cuda] [--workers 1,2] [--jobs N] [--batch N]

One worker process is one Python interpreter: its event loop (fetch, store, ack) and its model thread share one
GIL, so on a fast GPU the fleet's per-job Python work, not the model, bounds a single worker. The remedy serving
systems use is several worker processes per device, and this benchmark measures it. For each N:

1. a backlog of ``--jobs`` requests is published to ``fleet.req.embed`` (no worker is running yet);
2. N ``fleet worker --model embed`` processes start on the device;
3. the drain rate is measured from the moment all N report ``ready`` in their heartbeats until the backlog is
   down to a tenth (the last stragglers of a drain say nothing about throughput); then it drains completely and
   the last job's record is checked.

The bare loop (``benchmarks.bench_model``) runs in this process, before any worker, at the same batch size.
``--random-weights auto`` serves the same architecture with random weights where the packaged weights are
missing (same throughput). Services come from FLEET_BENCH_{NATS,REDIS}_URL or are started as in the tests.
Writes ``benchmarks/results/<--name>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

from benchmarks.bench_embed import query_texts
from benchmarks.bench_model import bare_transformers_throughput, use_random_weights
from benchmarks.common import RESULTS_DIR, best_of, services, show, stop_processes, write_result
from fleet import constants as c
from fleet.brokers import make_broker
from fleet.brokers.events import validated
from fleet.consumers.device import resolve_device
from fleet.consumers.handlers.embed import EmbedHandler
from fleet.producers.publish import publish_all
from fleet.schemas.wire import Heartbeat, RequestMessage
from fleet.settings import FleetSettings
from fleet.store import make_store
from tests.processes import fleet_argv, fleet_env

MODEL = "embed"
LOG_DIR = RESULTS_DIR / "bench_embed_fleet_logs"


class RandomWeightsEmbed(EmbedHandler):
    """``embed`` with random weights of the same architecture, served by import path where weights are missing."""

    def __init__(self, **options: Any) -> None:
        super().__init__(random_weights=True, **options)


@contextlib.contextmanager
def worker_processes(
    count: int, urls: dict[str, str], args: argparse.Namespace, tag: str
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` ``fleet worker`` processes; SIGTERM (drain) on the way out."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    model = "benchmarks.bench_embed_fleet:RandomWeightsEmbed" if args.random_weights_resolved else MODEL
    env = fleet_env(
        FLEET_BROKER_URL=urls["nats"],
        FLEET_STORE_URL=urls["redis"],
        FLEET_HEARTBEAT_INTERVAL_S="0.5",
        FLEET_LOG_LEVEL="INFO",
    )
    argv = ["worker", "--model", model, "--device", args.device_resolved, "--max-batch", str(args.batch)]
    argv += ["--max-wait-ms", str(args.max_wait_ms)]
    procs = []
    try:
        for i in range(count):
            with (LOG_DIR / f"{tag}-{i}.log").open("wb") as log:
                procs.append(subprocess.Popen(fleet_argv(*argv), env=env, stdout=log, stderr=subprocess.STDOUT))
        yield procs
        check_alive(procs)
    finally:
        stop_processes(procs, timeout_s=60)


def check_alive(procs: list[subprocess.Popen[bytes]]) -> None:
    dead = [p for p in procs if p.poll() is not None]
    if dead:
        raise SystemExit(f"a worker exited early (code {dead[0].returncode}); logs in {LOG_DIR}")


async def track_states(stream: Any, seen: dict[str, str]) -> None:
    """Keep ``seen`` (worker id -> state) up to date from the heartbeats, until ``stream`` is closed."""
    async for beat in validated(stream, Heartbeat, "worker heartbeat"):
        seen[beat.worker_id] = beat.state


async def drain_rate(urls: dict[str, str], args: argparse.Namespace, count: int, texts: list[str]) -> dict[str, Any]:
    settings = FleetSettings(broker_url=urls["nats"], store_url=urls["redis"])
    broker, store = make_broker(settings), make_store(settings)
    await broker.connect()
    await store.connect()
    subject, group = c.request_subject(MODEL), c.consumer_name(MODEL)
    try:
        await broker.ensure_model(MODEL)
        if await broker.lag(subject, group):
            raise SystemExit(f"{subject} already has a backlog; drain or remove it before benchmarking")
        messages = [RequestMessage(job_id=uuid.uuid4().hex, model=MODEL, input={"text": t}) for t in texts]
        await publish_all(broker, messages, concurrency=512)
        seen: dict[str, str] = {}
        beats = await broker.listen(c.heartbeat_subject(MODEL))
        watch = asyncio.create_task(track_states(beats, seen))
        with worker_processes(count, urls, args, f"n{count}") as procs:
            started = time.monotonic()
            while sum(state == "ready" for state in seen.values()) < count:
                check_alive(procs)
                if time.monotonic() - started > args.start_timeout_s:
                    raise SystemExit(f"{count} workers not ready within {args.start_timeout_s}s; logs in {LOG_DIR}")
                await asyncio.sleep(0.05)
            t0, lag0 = time.perf_counter(), await broker.lag(subject, group)
            lag, t1 = lag0, t0
            while lag > len(texts) // 10:
                await asyncio.sleep(0.05)
                lag, t1 = await broker.lag(subject, group), time.perf_counter()
            while await broker.lag(subject, group) > 0:  # noqa: ASYNC110 - polled
                await asyncio.sleep(0.05)
            last = await store.get(messages[-1].job_id)
            assert last is not None and last.state == "succeeded", last
        await beats.close()  # ends track_states (cancelling a NATS read is not reliable)
        await watch
        if lag0 < len(texts) // 2:
            print(f"note: with {count} workers only {lag0} of {len(texts)} jobs were left once all were ready")
        return {"workers": count, "jobs_per_s": (lag0 - lag) / (t1 - t0), "measured_jobs": lag0 - lag}
    finally:
        await store.close()
        await broker.close()


async def main(args: argparse.Namespace) -> None:
    args.device_resolved = resolve_device(args.device)
    cuda = args.device_resolved.startswith("cuda")
    args.jobs = args.jobs or (60000 if cuda else 3000)
    args.batch = args.batch or (256 if cuda else 64)
    args.random_weights_resolved = use_random_weights(args.random_weights)
    texts = query_texts(args.jobs, args.words)
    bare = best_of(
        [
            bare_transformers_throughput(texts, args.batch, args.device_resolved, args.random_weights_resolved)
            for _ in range(2)
        ]
    )
    runs = []
    with services() as urls:
        for count in args.workers:
            runs.append(await drain_rate(urls, args, count, texts))
            runs[-1]["ratio_to_bare"] = runs[-1]["jobs_per_s"] / bare
    results = {
        "bare_per_s": bare,
        "runs": runs,
        "params": {
            **{k: v for k, v in vars(args).items() if not k.endswith("_resolved")},
            "device": args.device_resolved,
            "random_weights": args.random_weights_resolved,
        },
    }
    rows = [(f"bare transformers items/s, batch {args.batch}", f"{bare:,.0f}", "")]
    for run in runs:
        n = run["workers"]
        rows.append((f"fleet jobs/s, {n} worker process{'es' if n > 1 else ''}", f"{run['jobs_per_s']:,.0f}", ""))
        rows.append((f"  ratio to bare, {n} worker{'s' if n > 1 else ''}", f"{run['ratio_to_bare']:.2f}", ""))
    show(
        f"embed over NATS + Redis, {args.device_resolved}, {args.words}-word texts, batch {args.batch}, "
        f"{args.jobs:,} jobs per point",
        rows,
    )
    print(f"wrote {write_result(args.name, results)}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--random-weights", choices=["auto", "yes", "no"], default="auto")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker process counts")
    parser.add_argument("--jobs", type=int, help="backlog per point (default: 60000 on CUDA, 3000 on CPU)")
    parser.add_argument("--words", type=int, default=16)
    parser.add_argument("--batch", type=int, help="max batch and bare batch (default: 256 on CUDA, 64 on CPU)")
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--start-timeout-s", type=float, default=180.0)
    parser.add_argument("--name", default="embed-fleet")
    args = parser.parse_args()
    args.workers = [int(n) for n in args.workers.split(",")]
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
