"""What tracing costs a worker: job throughput with tracing exporting to a real Jaeger, with it off, and before it.

    python -m benchmarks.bench_tracing [--jobs 4000] [--model-jobs 2000] [--rounds 5] [--before REV]
                                       [--workloads echo,mlp]

One ``Worker`` drains requests published ahead over NATS JetStream + Redis, each carrying a ``traceparent`` header
as the gateway's publish writes it; throughput is jobs / (the worker's start to its last job settled). Two
workloads:

* **echo** (``--jobs``): the cheapest model, about 70 us a job on the development machine: the per-job overhead is
  all there is, the worst case for tracing's share;
* **mlp** (``--model-jobs``): a model with a realistic cost: echo's handler whose ``predict`` first runs the batch
  through an 8-layer 2048-wide ReLU MLP in torch on one CPU thread (about 1 ms per item at the worker's batch
  sizes), in the worker's model thread as any model's compute runs (releasing the GIL as torch does). A tiny
  transformer from the tests costs well under 1 ms per item and ``embed`` needs a downloaded model: this is a
  fixed, reproducible cost in the range a small real model has on a CPU.

Four variants, each run in a fresh child process, interleaved round by round (so they share the machine's noise),
the median of ``--rounds``:

* **on**: ``OTEL_EXPORTER_OTLP_ENDPOINT`` points at a real Jaeger v1.75.0 (``tests/jaeger_service.py``), the
  ``OTEL_*`` defaults otherwise (parent-based sampling: every job is sampled; the worker's spans go through its
  OTLP/HTTP JSON exporter thread, ``fleet.tracing.export``). Every job gets its queue and process spans, every
  batch its batch, admit, compute and settle spans, all exported;
* **on-sampled**: the same with 1 job in ``round(1/--share)`` sampled upstream (the producer's flag);
* **off**: this checkout, no ``OTEL_*`` variable: the stage timings are written, the stage histograms observed,
  and tracing costs its ``is None`` checks;
* **before**: the same child run on the commit before tracing (``--before``; default: the first parent of the
  first-parent commit that added ``fleet/tracing``, i.e. on a branch that merged tracing in, the branch just before
  the merge), checked out in a temporary git worktree and removed after.

Targets: on / off >= 0.9; off / before >= 0.98, per workload. ``benchmarks/results/tracing.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACEPARENT = "00-{trace}-{span}-{flags}"


MLP_WIDTH, MLP_LAYERS = 2048, 8


def mlp_handler(echo: type) -> type:
    """Echo's handler with a realistic compute: the batch through an MLP (``MLP_LAYERS`` x ``MLP_WIDTH``) first."""
    import torch

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(MLP_WIDTH, MLP_WIDTH, generator=generator) / MLP_WIDTH**0.5 for _ in range(MLP_LAYERS)]

    class MlpHandler(echo):  # type: ignore[misc, valid-type]
        def predict(self, batch: list[Any]) -> list[Any]:
            x = torch.ones(len(batch), MLP_WIDTH)
            with torch.inference_mode():
                for w in weights:
                    x = torch.relu(x @ w)
            return list(super().predict(batch))

    return MlpHandler


async def child(args: argparse.Namespace) -> dict[str, Any]:
    """One run in this process: publish, start the worker, time the drain. Runs on whichever checkout is first on
    PYTHONPATH (this one or the 'before' worktree): it uses only what both have."""
    from fleet import constants as c
    from fleet.brokers import make_broker
    from fleet.consumers.handlers import with_name
    from fleet.consumers.handlers.echo import EchoHandler
    from fleet.consumers.worker import Worker
    from fleet.schemas.wire import RequestMessage
    from fleet.settings import FleetSettings
    from fleet.store import make_store

    settings = FleetSettings(broker_url=args.nats, store_url=args.redis, models="echo", heartbeat_interval_s=5)
    model = f"bt-{uuid.uuid4().hex[:10]}"
    handler = with_name(EchoHandler if args.workload == "echo" else mlp_handler(EchoHandler), model)
    broker, store = make_broker(settings), make_store(settings)
    await broker.connect()
    await store.connect()
    try:
        await broker.ensure_model(model)
        subject = c.request_subject(model)
        sem = asyncio.Semaphore(64)
        every = round(1 / args.sampled) if args.sampled > 0 else args.jobs + 1  # 1 in every: sampled upstream

        async def publish(i: int) -> None:
            job_id = f"{model}-{i}"
            data = RequestMessage(job_id=job_id, model=model, input={"text": f"t{i}"}).model_dump_json().encode()
            headers = {
                c.HEADER_JOB_ID: job_id,
                c.HEADER_MODEL: model,
                "traceparent": TRACEPARENT.format(
                    trace=uuid.uuid4().hex, span=uuid.uuid4().hex[:16], flags="01" if i % every == 0 else "00"
                ),
            }
            async with sem:
                await broker.publish(subject, data, msg_id=job_id, headers=headers)

        await asyncio.gather(*(publish(i) for i in range(args.jobs)))
        worker = Worker(handler(), broker, store, settings=settings)
        cpu = time.process_time()
        await worker.start()
        started = time.perf_counter()
        while worker.stats.items < args.jobs:  # noqa: ASYNC110 (polled: no event to wait on in both checkouts)
            await asyncio.sleep(0.005)
        settled = time.perf_counter() - started
        tracer = getattr(worker.settler, "tracing", None)
        traced = tracer is not None
        if traced:  # the spans the worker made go out before the clock stops: their export is part of the cost
            await asyncio.to_thread(tracer.flush)
        seconds = time.perf_counter() - started
        await worker.stop()
        sink = getattr(tracer, "spans", None)
        last = await store.get(f"{model}-{args.jobs - 1}")
        return {
            "jobs_per_s": args.jobs / seconds,
            "seconds": seconds,
            "seconds_to_last_settled": settled,
            "traced": traced,
            "trace_id": getattr(last, "trace_id", None),
            "worker_spans_exported": getattr(sink, "exported", None),
            "worker_spans_dropped": getattr(sink, "dropped", None),
            "exporter_thread_cpu_s": getattr(sink, "cpu_s", None),
            "process_cpu_s": time.process_time() - cpu,
        }
    finally:
        await store.close()
        await broker.close()


def run_child(tree: Path, env: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    jobs = args.jobs if args.workload == "echo" else args.model_jobs
    argv = [sys.executable, str(Path(__file__)), "--child", "--jobs", str(jobs), "--nats", args.nats]
    argv += ["--workload", args.workload]
    argv += ["--redis", args.redis, "--sampled", env.pop("SAMPLED", "1")]
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FLEET_"))}
    child_env.update(env, PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
    proc = subprocess.run(argv, env=child_env, capture_output=True, text=True, timeout=600, cwd=tree)
    if proc.returncode != 0:
        raise RuntimeError(f"child on {tree} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["spans_dropped"] = "dropping" in proc.stderr.lower()  # the batch span processor's queue overflowed
    result["spans_dropped"] = result["spans_dropped"] or bool(result.get("worker_spans_dropped"))
    return result


def before_commit(given: str | None) -> str:
    if given:
        return given
    # first-parent history: on a branch that merged tracing in, the merge (its first parent has every other change
    # of the branch: "off" against it is what tracing's hooks cost, not what the branch's other work costs)
    added = subprocess.run(
        ["git", "log", "--first-parent", "--diff-filter=A", "--format=%H", "--", "fleet/tracing/__init__.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if not added:
        raise SystemExit("no commit adds fleet/tracing: pass --before REV")
    return added[-1] + "^1"


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[tuple[Path, str]]:
    with tempfile.TemporaryDirectory(prefix="fleet-before-") as tmp:
        path = Path(tmp) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT, check=True, capture_output=True
        )
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True, check=True
            ).stdout.strip()
            yield path, commit
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, capture_output=True)


VARIANTS = ("before", "off", "on", "on-sampled")


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``), or None."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_workload(
    workload: str, args: argparse.Namespace, old: Path, on_env: dict[str, str], jaeger_pid: int | None
) -> dict[str, list[dict[str, Any]]]:
    """``--rounds`` rounds of the four variants of one workload, interleaved (the order flips every round)."""
    args.workload = workload
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    for round_no in range(args.rounds):
        sampled_env = {**on_env, "SAMPLED": str(args.share)}
        order = [("before", old, {}), ("off", ROOT, {}), ("on", ROOT, on_env), ("on-sampled", ROOT, sampled_env)]
        if round_no % 2:
            order.reverse()  # neither side always runs first
        for name, tree, env in order:
            jaeger_cpu = cpu_seconds(jaeger_pid)
            result = run_child(tree, dict(env), args)
            after = cpu_seconds(jaeger_pid)
            result["jaeger_cpu_s"] = after - jaeger_cpu if after is not None and jaeger_cpu is not None else None
            runs[name].append(result)
            print(f"{workload} round {round_no + 1} {name}: {result['jobs_per_s']:.0f} jobs/s", flush=True)
    assert all(r["traced"] and r["trace_id"] for r in runs["on"]), "the 'on' runs did not trace"
    assert all(r["traced"] for r in runs["on-sampled"]), "the 'on-sampled' runs did not trace"
    assert not any(r["traced"] for r in runs["off"]), "the 'off' runs traced"
    return runs


def summarise(workload: str, jobs: int, args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> dict:
    """Print and record the workload's table; its figures for the result file."""
    from benchmarks.common import show

    median = {name: statistics.median(r["jobs_per_s"] for r in rs) for name, rs in runs.items()}
    on_off, off_before = median["on"] / median["off"], median["off"] / median["before"]
    sampled_off = median["on-sampled"] / median["off"]

    def met(value: float, target: float) -> str:
        return f"{value:.3f} ({'met' if value >= target else 'NOT met'})"

    rows = [
        ("before (jobs/s, median)", f"{median['before']:.0f}", ""),
        ("off (jobs/s, median)", f"{median['off']:.0f}", ""),
        ("on, every job sampled, exporting to Jaeger (jobs/s, median)", f"{median['on']:.0f}", ""),
        (f"on, {args.share:.0%} of jobs sampled upstream (jobs/s, median)", f"{median['on-sampled']:.0f}", ""),
        ("on (every job) / off", met(on_off, 0.9), ">= 0.9"),
        (f"on ({args.share:.0%} sampled) / off", met(sampled_off, 0.9), ">= 0.9"),
        ("off / before", met(off_before, 0.98), ">= 0.98"),
    ]
    what = "echo (the worst case: ~70 us a job)" if workload == "echo" else "mlp (~1 ms of compute a job)"
    show(f"Tracing cost: {what} over NATS + Redis, {jobs} jobs x {args.rounds} rounds", rows)
    print(
        f"{workload}: on/off {on_off:.3f} (every job sampled), {sampled_off:.3f} ({args.share:.0%} sampled) "
        f"(target >= 0.9)   off/before {off_before:.3f} (target >= 0.98)"
    )
    return {
        "jobs": jobs,
        "jobs_per_s": {name: [round(r["jobs_per_s"], 1) for r in rs] for name, rs in runs.items()},
        "median_jobs_per_s": {name: round(v, 1) for name, v in median.items()},
        "median_ms_per_job_off": round(1000 / median["off"], 3),
        "runs_that_dropped_spans": {name: sum(bool(r["spans_dropped"]) for r in rs) for name, rs in runs.items()},
        "worker_spans_exported": {
            name: [r.get("worker_spans_exported") for r in rs] for name, rs in runs.items() if name.startswith("on")
        },
        "worker_spans_dropped": {
            name: [r.get("worker_spans_dropped") for r in rs] for name, rs in runs.items() if name.startswith("on")
        },
        "worker_process_cpu_us_per_job_median": {
            name: round(statistics.median(r["process_cpu_s"] for r in rs) / jobs * 1e6, 1)
            for name, rs in runs.items()
            if all(r.get("process_cpu_s") is not None for r in rs)
        },
        "exporter_thread_cpu_us_per_job_median": {
            name: round(statistics.median(r["exporter_thread_cpu_s"] for r in rs) / jobs * 1e6, 2)
            for name, rs in runs.items()
            if name.startswith("on") and all(r.get("exporter_thread_cpu_s") is not None for r in rs)
        },
        "jaeger_cpu_us_per_job_median": {
            name: round(statistics.median(r["jaeger_cpu_s"] for r in rs) / jobs * 1e6, 1)
            for name, rs in runs.items()
            if all(r.get("jaeger_cpu_s") is not None for r in rs)
        },
        "on_over_off": round(on_off, 4),
        "on_sampled_over_off": round(sampled_off, 4),
        "off_over_before": round(off_before, 4),
        "targets_met": {"on_over_off": on_off >= 0.9, "on_sampled_over_off": sampled_off >= 0.9,
                        "off_over_before": off_before >= 0.98},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=4000, help="jobs per echo run")
    parser.add_argument("--model-jobs", type=int, default=2000, help="jobs per mlp run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workloads", default="echo,mlp", help="comma-separated: echo, mlp")
    parser.add_argument("--before", default=None, help="the commit before tracing (default: found by git log)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", default="echo", choices=("echo", "mlp"), help=argparse.SUPPRESS)
    parser.add_argument("--nats", default="", help=argparse.SUPPRESS)
    parser.add_argument("--redis", default="", help=argparse.SUPPRESS)
    parser.add_argument("--sampled", type=float, default=1.0, help=argparse.SUPPRESS)
    parser.add_argument("--share", type=float, default=0.1, help="the sampled share of the 'on-sampled' variant")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(child(args))))
        return
    if args.jobs < 1 or args.model_jobs < 1 or args.rounds < 1:
        parser.error(
            f"--jobs, --model-jobs and --rounds must be at least 1, got {args.jobs}, {args.model_jobs}, {args.rounds}"
        )
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in workloads if w not in ("echo", "mlp")]
    if unknown or not workloads:
        parser.error(f"--workloads {args.workloads!r}: choose from echo, mlp")
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import services, write_result
    from tests.jaeger_service import jaeger_server

    rev = before_commit(args.before)
    figures: dict[str, Any] = {"rounds": args.rounds, "sampled_share": args.share, "workloads": {}}
    figures["load_average_before"] = list(os.getloadavg())
    with services(nats=True, redis=True) as urls, jaeger_server() as jaeger, worktree(rev) as (old, commit):
        args.nats, args.redis = urls["nats"], urls["redis"]
        on_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.otlp_endpoint, "OTEL_SERVICE_NAME": "fleet-bench-tracing"}
        for workload in workloads:
            runs = run_workload(workload, args, old, on_env, jaeger.pid)
            jobs = args.jobs if workload == "echo" else args.model_jobs
            figures["workloads"][workload] = summarise(workload, jobs, args, runs)
    figures["before_commit"] = commit
    figures["mlp"] = {"width": MLP_WIDTH, "layers": MLP_LAYERS, "torch_threads": 1}
    figures["sampled_flag"] = (
        "the producer's traceparent flag: 01 on 1 in round(1/share) jobs, 00 on the others; the worker's "
        "parent-based sampler (the default) follows it"
    )
    figures["clock"] = "the worker's start to its last job settled and (tracing on) its spans flushed to Jaeger"
    figures["load_average_after"] = list(os.getloadavg())
    print(f"wrote {write_result('tracing', figures)}")


if __name__ == "__main__":
    main()
