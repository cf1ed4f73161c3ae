"""(b) `embed` through the fleet with micro-batching vs the same fleet with a maximum batch of 1, and
(c) fleet `embed` throughput vs a bare transformers loop at the same batch size.

    python -m benchmarks.bench_embed [--infra memory|nats] [--device auto|cpu|cuda] [--random-weights]

Each fleet run publishes every job up front (one text per job), then starts the worker and measures from the
moment it is ready until the last job is acked, so it reports a worker's saturation throughput from a backlog:
model compute plus fetch, store and ack, overlapped as the worker overlaps them.
``--random-weights`` builds the same architecture with random weights (same throughput), for machines that lack
the packaged weights; ``auto`` (the default) uses them only when the packaged weights are missing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import uuid
from collections.abc import Iterator

from benchmarks.bench_model import bare_transformers_throughput, use_random_weights
from benchmarks.common import Timer, best_of, services, show, write_result
from fleet import constants as c
from fleet.brokers import make_broker
from fleet.consumers.device import resolve_device
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.embed import EmbedHandler
from fleet.consumers.worker import Worker
from fleet.producers.publish import publish_all
from fleet.schemas.wire import RequestMessage
from fleet.settings import FleetSettings
from fleet.store import make_store

WORDS = "fleet serves models to many users quickly and the queue keeps every request safe while workers batch".split()


def query_texts(count: int, words: int, seed: int = 11) -> list[str]:
    """Short search-query-like sentences of ``words`` words (varied, so batches are not all identical)."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


@contextlib.contextmanager
def infra_settings(kind: str, **values: object) -> Iterator[FleetSettings]:
    if kind == "memory":
        yield FleetSettings(**values)  # type: ignore[arg-type]
        return
    with services() as urls:
        yield FleetSettings(broker_url=urls["nats"], store_url=urls["redis"], **values)  # type: ignore[arg-type]


async def fleet_embed(
    settings: FleetSettings, texts: list[str], max_batch: int, device: str, random_weights: bool
) -> float:
    """Jobs per second of `embed` through a worker with ``max_batch``."""
    broker, store = make_broker(settings), make_store(settings)
    await broker.connect()
    await store.connect()
    model = f"embed-{uuid.uuid4().hex[:8]}"
    handler = with_name(EmbedHandler, model)(device=device, random_weights=random_weights)
    try:
        # The backlog is published before the worker starts, so the clock sees the worker alone (a deployment's
        # producers run elsewhere): from the moment it is ready until the last job is acked.
        await broker.ensure_model(model)
        messages = [RequestMessage(job_id=uuid.uuid4().hex, model=model, input={"text": t}) for t in texts]
        await publish_all(broker, messages)
        async with Worker(handler, broker, store, settings=settings, device=device, max_batch=max_batch):
            with Timer() as t:  # start() has returned: loaded, warmed up, and not one job fetched yet
                while await broker.lag(c.request_subject(model), c.consumer_name(model)) > 0:  # noqa: ASYNC110 - polled
                    await asyncio.sleep(0.01)
            last = await store.get(messages[-1].job_id)
            assert last is not None and last.state == "succeeded", last
    finally:
        await store.close()
        await broker.close()
    return len(texts) / t.seconds


async def main(args: argparse.Namespace) -> None:
    device = resolve_device(args.device)
    random_weights = use_random_weights(args.random_weights)
    texts = query_texts(args.jobs, args.words)
    batched_runs, bare_runs = [], []
    with infra_settings(args.infra, max_wait_ms=args.max_wait_ms, device=device) as settings:
        single = await fleet_embed(settings, texts[: args.single_jobs], 1, device, random_weights)
        for _ in range(args.repeats):  # interleaved, best of each: the machine's noise hits both sides alike
            batched_runs.append(await fleet_embed(settings, texts, args.batch, device, random_weights))
            bare_runs.append(bare_transformers_throughput(texts, args.batch, device, random_weights))
    batched, bare = best_of(batched_runs), best_of(bare_runs)
    results = {
        "b_batching_vs_batch_1": {
            "fleet_batched_per_s": batched,
            "fleet_batch_1_per_s": single,
            "ratio": batched / single,
            "target": 5.0,
        },
        "c_fleet_vs_bare_transformers": {
            "fleet_per_s": batched,
            "bare_per_s": bare,
            "ratio": batched / bare,
            "target": 0.9,
            "fleet_runs": batched_runs,
            "bare_runs": bare_runs,
        },
        "params": {**vars(args), "device": device, "random_weights": random_weights},
    }
    show(
        f"embed through the fleet ({args.infra}, {device}, {args.words}-word texts, batch {args.batch})",
        [
            ("(b) fleet jobs/s, max_batch " + str(args.batch), f"{batched:,.1f}", ""),
            ("(b) fleet jobs/s, max_batch 1", f"{single:,.1f}", ""),
            ("(b) ratio batched / batch 1", f"{batched / single:.2f}", ">= 5 (CPU)"),
            ("(c) bare transformers items/s, batch " + str(args.batch), f"{bare:,.1f}", ""),
            ("(c) ratio fleet / bare", f"{batched / bare:.2f}", ">= 0.9"),
        ],
    )
    print(f"wrote {write_result(args.name, results)}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--infra", choices=["memory", "nats"], default="memory", help="nats: NATS + Redis")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--random-weights", choices=["auto", "yes", "no"], default="auto")
    parser.add_argument("--jobs", type=int, default=3000, help="jobs for the batched run and the bare loop")
    parser.add_argument("--single-jobs", type=int, default=800, help="jobs for the max_batch=1 run")
    parser.add_argument("--words", type=int, default=8, help="words per text")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs of (c); the best of each is kept")
    parser.add_argument("--name", default="embed", help="result file name under benchmarks/results/")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
