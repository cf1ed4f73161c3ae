"""One ``bench_compact`` run of an older Fleet: run with that Fleet's tree first on ``sys.path`` (``bench_compact``
exports the tree with ``git archive`` and starts this file inside it). Today's code imports only
``callgrind_window`` from it, which imports no Fleet module.

    python compact_baseline.py NATS_URL REDIS_URL JOBS BATCH MAX_WAIT_MS

It does what ``bench_compact.one_run`` does with the ``float`` configuration, through the older tree's own API
(which has no ``encoding_format``): publish ``JOBS`` requests first, then time one in-process worker with a
zero-cost ``embed`` model until the last record is terminal. Prints one JSON line: jobs/s, Redis CPU µs per result
(``INFO cpu``), and the ``STRLEN`` and ``MEMORY USAGE`` of a finished record.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any


def main() -> None:
    nats_url, redis_url = sys.argv[1], sys.argv[2]
    jobs, batch, max_wait_ms = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    print(json.dumps(asyncio.run(one_run(nats_url, redis_url, jobs, batch, max_wait_ms))))


async def one_run(nats_url: str, redis_url: str, jobs: int, batch: int, max_wait_ms: float) -> dict[str, Any]:
    import numpy as np
    import redis.asyncio as aioredis

    from fleet import constants as c
    from fleet.brokers import make_broker
    from fleet.consumers.handlers import with_name
    from fleet.consumers.handlers.embed import EmbedHandler
    from fleet.consumers.worker import Worker
    from fleet.producers.publish import publish_all
    from fleet.schemas.models import EMBED_DIM, EmbedOutput
    from fleet.schemas.wire import RequestMessage
    from fleet.settings import FleetSettings
    from fleet.store import make_store

    row = np.random.default_rng(7).standard_normal(EMBED_DIM).astype(np.float32) / 20

    class FixedEmbed(EmbedHandler):  # type: ignore[misc, valid-type]  # the older tree's class
        """As that tree's ``predict`` built outputs: lists from the batch's float32 array (``tolist``)."""

        def load(self) -> None:
            pass

        def predict(self, batch: list[Any]) -> list[Any]:
            vectors = np.repeat(row[None, :], len(batch), axis=0).tolist()
            return [EmbedOutput.model_construct(dim=EMBED_DIM, embedding=v) for v in vectors]

        def sample_input(self) -> None:  # type: ignore[override]  # no warm-up input: nothing is loaded
            return None

    settings = FleetSettings(broker_url=nats_url, store_url=redis_url, max_batch=batch, max_wait_ms=max_wait_ms)
    model = f"embed-{uuid.uuid4().hex[:8]}"
    broker, store = make_broker(settings), make_store(settings)
    redis = aioredis.Redis.from_url(redis_url)
    await broker.connect()
    await store.connect()
    try:
        await broker.ensure_model(model)
        messages = [RequestMessage(job_id=uuid.uuid4().hex, model=model, input={"text": f"t{i}"}) for i in range(jobs)]
        await publish_all(broker, messages, concurrency=256)
        cpu0 = await redis_cpu_s(redis)
        started = time.perf_counter()
        with callgrind_window():
            async with Worker(with_name(FixedEmbed, model)(), broker, store, settings=settings):
                while await broker.lag(c.request_subject(model), c.consumer_name(model)) > 0:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
                record = await store.wait(messages[-1].job_id, 60)
                seconds = time.perf_counter() - started
        cpu_s = await redis_cpu_s(redis) - cpu0
        assert record is not None and record.state == "succeeded", record
        key = c.job_key(messages[-1].job_id)
        strlen, usage = int(await redis.strlen(key)), int(await redis.memory_usage(key) or 0)
    finally:
        await redis.aclose()
        await store.close()
        await broker.close()
    return {"jobs_per_s": jobs / seconds, "redis_cpu_us": 1e6 * cpu_s / jobs, "strlen": strlen, "mem": usage}


CALLGRIND_ENV = "FLEET_BENCH_CALLGRIND"


@contextlib.contextmanager
def callgrind_window() -> Iterator[None]:
    """Under ``bench_instructions`` (the process started by ``valgrind --tool=callgrind --instr-atstart=no`` with
    ``FLEET_BENCH_CALLGRIND`` set) count instructions only inside this block; a no-op otherwise. Defined here, in
    the file that runs inside the older tree too, so both sides of the comparison open the same window."""
    if not os.environ.get(CALLGRIND_ENV):
        yield
        return
    pid = str(os.getpid())
    subprocess.run(["callgrind_control", "--instr=on", pid], check=True, capture_output=True)
    try:
        yield
    finally:
        subprocess.run(["callgrind_control", "--instr=off", pid], check=True, capture_output=True)


async def redis_cpu_s(redis: Any) -> float:
    info = await redis.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


if __name__ == "__main__":
    main()
