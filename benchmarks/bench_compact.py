"""Compact results: a zero-cost ``embed`` worker over NATS + Redis, float against base64 outputs, side by side.

    python -m benchmarks.bench_compact [--jobs 20000] [--batch 64] [--repeats 2]

The model costs nothing (``FixedEmbed``: the same 384 float32 values for every text, no weights), so what is
measured is Fleet's own work per job: admission, the two store writes, the ack. Four configurations run
interleaved in one process against the same servers, ``--repeats`` times each (the best run is kept):

* ``legacy``: float outputs serialised as before compact results (the output dumped by pydantic, the record by
  pydantic's serializer): the "before" of the jobs/s figure;
* ``float``: float outputs, records by orjson (today's default);
* ``base64``: ``encoding_format: base64``, records by orjson;
* ``base64 (memory store)``: the same worker on the in-memory store, the ceiling the Redis store is held to;
* ``float, at filing``: Fleet as it was when issue 14 was filed (commit ``FILING_COMMIT``, the parent of the issue's
  first commit), exported with ``git archive`` into a temporary directory and run by ``compact_baseline.py`` in a
  subprocess against the same servers: "today's jobs/s" of the issue, measured now rather than quoted (``legacy``
  above carries every later change but the record serialiser). Left out, with a note, where git or the commit
  is missing (a tarball, a shallow clone);
* ``raw nats-py drain``: nats-py's own pull consumer fetching ``--batch`` messages at a time and acking each, on
  the same prefilled requests, with no store and no model: what the broker's client alone reaches per process,
  the ceiling of any worker built on it.

Rounds run every configuration once, in the order above; the jobs/s ratio against Fleet at filing is printed for the
best runs and as the median of each round's own ratio. Each run publishes ``--jobs`` requests to a fresh subject
first (no worker running), then starts one in-process worker and times the drain until the last record is
terminal. Redis CPU per result is the growth of ``used_cpu_sys + used_cpu_user`` (``INFO cpu``) over the drain
divided by the jobs; bytes per result is the ``STRLEN`` and ``MEMORY USAGE`` of a finished record's key.
Services come from FLEET_BENCH_{NATS,REDIS}_URL or are started as in the tests.
Writes ``benchmarks/results/compact.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import numpy as np
import redis.asyncio as aioredis

from benchmarks.common import best_of, fetch_and_ack, paired_median, pooled, services, show, write_result
from benchmarks.compact_baseline import callgrind_window
from fleet import constants as c
from fleet.brokers import make_broker
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.base import ModelHandler
from fleet.consumers.handlers.embed import EmbedHandler
from fleet.consumers.worker import Worker
from fleet.producers.publish import publish_all
from fleet.schemas.models import EMBED_DIM, EmbedInput, EmbedOutput
from fleet.schemas.wire import RequestMessage
from fleet.settings import FleetSettings
from fleet.store import make_store, transitions

# main when issue 14 was filed (the parent of the first commit, "Compact results: encoding_format ...").
FILING_COMMIT = "79d2709"
REPO = Path(__file__).resolve().parent.parent
MODES = ("filing", "legacy", "float", "base64", "base64-memory", "raw")
REDIS_MODES = ("filing", "legacy", "float", "base64")
TITLES = {
    "filing": f"float, at filing ({FILING_COMMIT})",
    "legacy": "float, before (pydantic)",
    "float": "float (orjson)",
    "base64": "base64 (orjson)",
    "base64-memory": "base64, in-memory store",
    "raw": "raw nats-py drain (no store, no model)",
}
_ROW = np.random.default_rng(7).standard_normal(EMBED_DIM).astype(np.float32) / 20


class FixedEmbed(EmbedHandler):
    """``embed`` at zero cost: no weights, and the forward pass replaced by the same unit-scale vector for every
    text; the outputs are built as the real ``predict`` builds them (float32 rows of the batch's array)."""

    def load(self) -> None:
        """Nothing to load."""

    def embed_with_tokens(self, texts: list[str]) -> tuple[np.ndarray, list[int]]:
        return np.repeat(_ROW[None, :], len(texts), axis=0), [2] * len(texts)

    def sample_input(self) -> None:  # type: ignore[override]
        return None


class LegacyFixedEmbed(FixedEmbed):
    """``FixedEmbed`` with the output path of before: vectors as lists (the array's ``tolist``), the output dumped
    by pydantic."""

    def predict(self, batch: list[EmbedInput]) -> list[EmbedOutput | Exception]:
        vectors = self.embed_array([t for item in batch for t in item.items()]).tolist()
        outputs: list[EmbedOutput | Exception] = []
        start = 0
        for item in batch:
            n = len(item.items())
            vecs, start = vectors[start : start + n], start + n
            if item.text is not None:
                outputs.append(EmbedOutput.model_construct(dim=EMBED_DIM, embedding=vecs[0]))
            else:
                outputs.append(EmbedOutput.model_construct(dim=EMBED_DIM, embeddings=vecs))
        return outputs

    def output_json(self, output: EmbedOutput, encoding: str = "float") -> Any:
        return ModelHandler.output_json(self, output, encoding)


@contextlib.contextmanager
def legacy_records(enabled: bool) -> Iterator[None]:
    """While ``enabled``: records serialised by pydantic's serializer, as before orjson."""
    saved = transitions.record_json
    if enabled:
        transitions.record_json = transitions._SERIALIZER.to_json  # type: ignore[assignment]
    try:
        yield
    finally:
        transitions.record_json = saved  # type: ignore[assignment]


async def redis_cpu_s(redis: aioredis.Redis) -> float:
    info = await redis.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def one_run(mode: str, urls: dict[str, str], args: argparse.Namespace, redis: aioredis.Redis) -> dict[str, Any]:
    """Prefill ``args.jobs`` requests, then drain them with one worker; jobs/s, Redis CPU and bytes per result."""
    memory = mode.endswith("memory")
    settings = FleetSettings(
        broker_url=urls["nats"],
        store_url="memory://" if memory else urls["redis"],
        max_batch=args.batch,
        max_wait_ms=args.max_wait_ms,
    )
    encoding = "float" if mode in ("legacy", "float") else "base64"
    model = f"embed-{uuid.uuid4().hex[:8]}"
    handler = with_name(LegacyFixedEmbed if mode == "legacy" else FixedEmbed, model)()
    broker, store = make_broker(settings), make_store(settings)
    await broker.connect()
    await store.connect()
    try:
        await broker.ensure_model(model)
        messages = [
            RequestMessage(job_id=uuid.uuid4().hex, model=model, input={"text": f"t{i}"}, encoding_format=encoding)
            for i in range(args.jobs)
        ]
        await publish_all(broker, messages, concurrency=256)
        with legacy_records(mode == "legacy"):
            cpu0 = await redis_cpu_s(redis)
            started = time.perf_counter()
            with callgrind_window():
                async with Worker(handler, broker, store, settings=settings):
                    await drained(store, messages[-1].job_id, broker, model)
                    seconds = time.perf_counter() - started
            cpu_s = await redis_cpu_s(redis) - cpu0
        last = messages[-1].job_id
        record = await store.get(last)
        assert record is not None and record.state == "succeeded", record
        strlen = 0 if memory else int(await redis.strlen(c.job_key(last)))
        usage = 0 if memory else int(await redis.memory_usage(c.job_key(last)) or 0)
    finally:
        await store.close()
        await broker.close()
    return {"jobs_per_s": args.jobs / seconds, "redis_cpu_us": 1e6 * cpu_s / args.jobs, "strlen": strlen, "mem": usage}


def export_tree(commit: str, into: Path) -> str | None:
    """Fleet's tree at ``commit`` under ``into`` with ``compact_baseline.py`` beside it; None, or why not."""
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True)
    except FileNotFoundError:
        return "git is not installed"
    except subprocess.CalledProcessError as exc:
        return f"git archive {commit} failed: {exc.stderr.decode(errors='replace').strip()[:200]}"
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    shutil.copy(Path(__file__).with_name("compact_baseline.py"), into / "compact_baseline.py")
    return None


async def filing_run(tree: Path, urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """``compact_baseline.py`` inside the exported tree: the older Fleet's imports resolve there, not here."""
    argv = [sys.executable, str(tree / "compact_baseline.py"), urls["nats"], urls["redis"]]
    argv += [str(args.jobs), str(args.batch), str(args.max_wait_ms)]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the run at {FILING_COMMIT} failed:\n{err.decode(errors='replace')[-2000:]}")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def raw_run(urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """nats-py alone: prefill a stream with the same request bodies, then fetch ``batch`` at a time and ack each."""
    nc = await nats.connect(urls["nats"])
    js = nc.jetstream()
    token = uuid.uuid4().hex[:8]
    stream, subject = f"RAW_{token}", f"raw.{token}"
    await js.add_stream(name=stream, subjects=[subject])
    try:
        bodies = [
            RequestMessage(job_id=uuid.uuid4().hex, model="raw", input={"text": f"t{i}"}).model_dump_json().encode()
            for i in range(args.jobs)
        ]

        async def publish(body: bytes) -> None:
            await js.publish(subject, body)

        await pooled(bodies, 256, publish)
        sub = await js.pull_subscribe(subject, durable=f"raw-{token}", stream=stream)
        started = time.perf_counter()
        await fetch_and_ack(sub, args.jobs, args.batch)
        seconds = time.perf_counter() - started
    finally:
        await js.delete_stream(stream)
        await nc.close()
    return {"jobs_per_s": args.jobs / seconds, "redis_cpu_us": 0.0, "strlen": 0, "mem": 0}


async def drained(store: Any, last_job: str, broker: Any, model: str) -> None:
    """Until the backlog is consumed and the last job's record is terminal."""
    while await broker.lag(c.request_subject(model), c.consumer_name(model)) > 0:  # noqa: ASYNC110 - polled
        await asyncio.sleep(0.02)
    record = await store.wait(last_job, 60)
    assert record is not None and record.terminal, record


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="fleet-at-filing-") as tmp:
        tree = Path(tmp)
        missing = export_tree(FILING_COMMIT, tree)
        if missing is not None:
            print(f"note: {TITLES['filing']} is not measured: {missing}")
        await measure(args, None if missing else tree)


async def measure(args: argparse.Namespace, tree: Path | None) -> None:
    modes = [mode for mode in MODES if mode != "filing" or tree is not None]
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    with services(nats=True, redis=True) as urls:
        redis = aioredis.Redis.from_url(urls["redis"])
        try:
            await one_run("float", urls, argparse.Namespace(**{**vars(args), "jobs": 2000}), redis)  # warm up
            for _ in range(args.repeats):
                for mode in modes:
                    if mode == "filing":
                        assert tree is not None
                        runs[mode].append(await filing_run(tree, urls, args))
                    elif mode == "raw":
                        runs[mode].append(await raw_run(urls, args))
                    else:
                        runs[mode].append(await one_run(mode, urls, args, redis))
                    print(f"  {TITLES[mode]}: {runs[mode][-1]['jobs_per_s']:,.0f} jobs/s", flush=True)
        finally:
            await redis.aclose()
    best = {mode: max(rs, key=lambda r: r["jobs_per_s"]) for mode, rs in runs.items()}
    rate = {mode: best_of([r["jobs_per_s"] for r in rs]) for mode, rs in runs.items()}
    cpu = {mode: min(r["redis_cpu_us"] for r in rs) for mode, rs in runs.items()}
    params = {**vars(args), "filing_commit": FILING_COMMIT}
    ratios: dict[str, float] = {
        "float_over_legacy_jobs_per_s": rate["float"] / rate["legacy"],
        "base64_over_legacy_jobs_per_s": rate["base64"] / rate["legacy"],
        "base64_redis_over_memory_jobs_per_s": rate["base64"] / rate["base64-memory"],
        "base64_over_float_redis_cpu": cpu["base64"] / cpu["float"],
        "base64_over_legacy_redis_cpu": cpu["base64"] / cpu["legacy"],
        "base64_over_float_bytes": best["base64"]["strlen"] / best["float"]["strlen"],
        "base64_over_raw_drain_jobs_per_s": rate["base64"] / rate["raw"],
    }
    if "filing" in runs:
        ratios["base64_over_filing_jobs_per_s"] = rate["base64"] / rate["filing"]
        ratios["base64_over_filing_jobs_per_s_paired"] = paired_median(
            [r["jobs_per_s"] for r in runs["base64"]], [r["jobs_per_s"] for r in runs["filing"]]
        )
        ratios["base64_over_filing_redis_cpu"] = cpu["base64"] / cpu["filing"]
    redis_modes = [m for m in REDIS_MODES if m in runs]
    rows = [(f"{TITLES[m]}: jobs/s", f"{rate[m]:,.0f}", "") for m in runs]
    rows += [(f"{TITLES[m]}: Redis CPU µs / result", f"{cpu[m]:.1f}", "") for m in redis_modes]
    rows += [
        (f"{TITLES[m]}: bytes / result (STRLEN, MEMORY USAGE)", f"{best[m]['strlen']:,} / {best[m]['mem']:,}", "")
        for m in redis_modes
    ]
    if "filing" in runs:
        rows += [
            ("ratio jobs/s base64 / at filing", f"{ratios['base64_over_filing_jobs_per_s']:.2f}", ">= 2 (issue 14)"),
            ("  the same, median of the rounds", f"{ratios['base64_over_filing_jobs_per_s_paired']:.2f}", ""),
            ("ratio Redis CPU base64 / at filing", f"{ratios['base64_over_filing_redis_cpu']:.2f}", "<= 0.5"),
        ]
    rows += [
        ("ratio jobs/s float / before", f"{ratios['float_over_legacy_jobs_per_s']:.2f}", ">= 2 (issue 14)"),
        ("ratio jobs/s base64 / before", f"{ratios['base64_over_legacy_jobs_per_s']:.2f}", ">= 2 (issue 14)"),
        ("ratio jobs/s Redis / memory (base64)", f"{ratios['base64_redis_over_memory_jobs_per_s']:.2f}", ">= 0.8"),
        ("ratio Redis CPU base64 / float", f"{ratios['base64_over_float_redis_cpu']:.2f}", "<= 0.5"),
        ("ratio Redis CPU base64 / before", f"{ratios['base64_over_legacy_redis_cpu']:.2f}", "<= 0.5"),
        ("ratio bytes base64 / float", f"{ratios['base64_over_float_bytes']:.2f}", "base64 <= 2.2 KB"),
        ("ratio jobs/s base64 / raw nats-py drain", f"{ratios['base64_over_raw_drain_jobs_per_s']:.2f}", "ceiling"),
    ]
    show(f"Compact results: zero-cost embed worker over NATS + Redis ({args.jobs:,} jobs, batch {args.batch})", rows)
    results = {"runs": runs, "jobs_per_s": rate, "redis_cpu_us": cpu, "best": best, "ratios": ratios}
    results["params"] = params
    print(json.dumps({"jobs_per_s": rate, "redis_cpu_us": cpu, "ratios": ratios}))
    print(f"wrote {write_result('compact', results)}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-wait-ms", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs of each configuration; best kept")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
