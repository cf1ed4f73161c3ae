"""Instructions per job of a zero-cost ``embed`` worker, and Redis's per result: today against Fleet at filing,
counted by callgrind.

    python -m benchmarks.bench_instructions [--jobs 2000,6000]

``bench_compact`` times the same worker, and on a shared two-core machine its jobs/s move by a third from run to
run (other tenants' load, the servers sharing the cores). This benchmark counts instead of timing: the worker
process runs under ``valgrind --tool=callgrind --instr-atstart=no``, and instructions are counted only from the
worker's start to the last terminal record (``compact_baseline.callgrind_window``), the same window on both sides.
Callgrind counts the same instructions for the same work whatever else the machine does. Each side drains two
backlogs (``--jobs``, default 2,000 and 6,000 prefilled requests); the difference of the two counts divided by the
difference of the jobs is the cost of one more job, without the worker's start and stop. The NATS and Redis
servers run outside valgrind there. Then the same drains run again with the worker outside valgrind and a
redis-server of their own under it (counting from its start to its shutdown, so the difference of the two drains
is again the cost of one more result): the instructions Redis spends per result, the counted form of
``bench_compact``'s Redis CPU per result.

* ``base64``: today's worker, ``encoding_format: base64`` (``bench_compact``'s ``base64`` run);
* ``float``: today's worker, float outputs;
* ``float, at filing``: Fleet at ``bench_compact.FILING_COMMIT``, as ``bench_compact`` runs it (``git archive``).

Instructions are not time (a cache miss costs more than an add), so the jobs/s ratios of ``bench_compact`` stay the
measure of the issue's targets; this one says how much work per job went away, repeatably. Needs valgrind
(Debian's ``valgrind``). Under valgrind a process runs about 50 times slower: about eight minutes in all.
Writes ``benchmarks/results/instructions.json``.
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
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from benchmarks import bench_compact as bc
from benchmarks.common import services, show, write_result
from benchmarks.compact_baseline import CALLGRIND_ENV
from tests import services as svc

SIDES = ("base64", "float", "filing")
TITLES = {"base64": "base64, today", "float": "float, today", "filing": f"float, at filing ({bc.FILING_COMMIT})"}


def totals(out_file: Path) -> int:
    """The instructions a callgrind output file counted (its ``totals:`` line)."""
    for line in out_file.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"{out_file} has no totals line: did callgrind finish?")


def run_side(argv: list[str], cwd: Path, pythonpath: Path, out_file: Path | None) -> dict[str, Any]:
    """``argv`` (a Python command printing one JSON line last), under callgrind when ``out_file`` is given (then
    with the instructions it counted); its JSON."""
    command, env = argv, {**os.environ, "PYTHONPATH": str(pythonpath)}
    if out_file is not None:
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out_file}", *argv]
        env[CALLGRIND_ENV] = "1"
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])}... failed:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if out_file is not None:
        result["instructions"] = totals(out_file)
    return result


def counted_redis(out_file: Path) -> contextlib.AbstractContextManager[str]:
    """A redis-server of its own under callgrind, as the tests start one; its URL. Its counts are in ``out_file``
    once the block ends (the server is stopped with SIGTERM and shuts down cleanly)."""
    wrapper = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}"]
    return svc.redis_server(wrapper=wrapper, timeout_s=120)


def child(mode: str, nats_url: str, redis_url: str, jobs: int) -> None:
    """One ``bench_compact`` run of ``mode`` in this process (the command ``side_argv`` gives for today's tree)."""

    async def main() -> dict[str, Any]:
        redis = aioredis.Redis.from_url(redis_url)
        try:
            args = argparse.Namespace(jobs=jobs, batch=64, max_wait_ms=2.0)
            return await bc.one_run(mode, {"nats": nats_url, "redis": redis_url}, args, redis)
        finally:
            await redis.aclose()

    print(json.dumps(asyncio.run(main())))


def side_argv(side: str, tree: Path | None, nats_url: str, redis_url: str, jobs: int) -> tuple[list[str], Path]:
    """The command of one drain of ``side`` and the directory (and import root) it runs in."""
    if side == "filing":
        assert tree is not None
        return [sys.executable, "compact_baseline.py", nats_url, redis_url, str(jobs), "64", "2.0"], tree
    argv = [sys.executable, "-m", "benchmarks.bench_instructions", "--child", side, nats_url, redis_url, str(jobs)]
    return argv, bc.REPO


def measure(args: argparse.Namespace, tree: Path | None, tmp: Path) -> None:
    small, large = args.jobs
    sides = [side for side in SIDES if side != "filing" or tree is not None]
    worker: dict[str, dict[int, int]] = {side: {} for side in sides}
    redis: dict[str, dict[int, int]] = {side: {} for side in sides}
    with services(nats=True, redis=True) as urls:
        for side in sides:
            for jobs in (small, large):
                argv, root = side_argv(side, tree, urls["nats"], urls["redis"], jobs)
                worker[side][jobs] = run_side(argv, root, root, tmp / f"worker.{side}.{jobs}.out")["instructions"]
                print(f"  {TITLES[side]}, {jobs:,} jobs: worker {worker[side][jobs]:,} instructions", flush=True)
        for side in sides:
            for jobs in (small, large):
                out_file = tmp / f"redis.{side}.{jobs}.out"
                with counted_redis(out_file) as redis_url:
                    argv, root = side_argv(side, tree, urls["nats"], redis_url, jobs)
                    run_side(argv, root, root, None)
                redis[side][jobs] = totals(out_file)
                print(f"  {TITLES[side]}, {jobs:,} jobs: redis-server {redis[side][jobs]:,} instructions", flush=True)
    per_job = {side: (c[large] - c[small]) / (large - small) for side, c in worker.items()}
    per_result = {side: (c[large] - c[small]) / (large - small) for side, c in redis.items()}
    rows = [(f"{TITLES[s]}: worker instructions / job", f"{per_job[s]:,.0f}", "") for s in sides]
    rows += [(f"{TITLES[s]}: Redis instructions / result", f"{per_result[s]:,.0f}", "") for s in sides]
    ratios: dict[str, float] = {
        "worker_float_over_base64": per_job["float"] / per_job["base64"],
        "redis_base64_over_float": per_result["base64"] / per_result["float"],
    }
    if "filing" in per_job:
        ratios["worker_filing_over_base64"] = per_job["filing"] / per_job["base64"]
        ratios["worker_filing_over_float"] = per_job["filing"] / per_job["float"]
        ratios["redis_base64_over_filing"] = per_result["base64"] / per_result["filing"]
        rows += [
            (
                "ratio worker at filing / base64 (work per job gone)",
                f"{ratios['worker_filing_over_base64']:.2f}",
                "",
            ),
            ("ratio worker at filing / float", f"{ratios['worker_filing_over_float']:.2f}", ""),
            ("ratio Redis base64 / at filing", f"{ratios['redis_base64_over_filing']:.2f}", ""),
        ]
    rows += [
        ("ratio worker float / base64", f"{ratios['worker_float_over_base64']:.2f}", ""),
        ("ratio Redis base64 / float", f"{ratios['redis_base64_over_float']:.2f}", ""),
    ]
    show(f"Instructions per job, callgrind ({small:,} and {large:,} jobs a side)", rows)
    results = {
        "worker_counts": worker,
        "redis_counts": redis,
        "worker_instructions_per_job": per_job,
        "redis_instructions_per_result": per_result,
        "ratios": ratios,
        "params": vars(args),
    }
    print(json.dumps({"worker_instructions_per_job": per_job, "redis_instructions_per_result": per_result}))
    print(json.dumps({"ratios": ratios}))
    print(f"wrote {write_result('instructions', results)}")


def job_counts(value: str) -> tuple[int, int]:
    try:
        small, large = (int(part) for part in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two job counts like 2000,6000, got {value!r}") from None
    if not 0 < small < large:
        raise argparse.ArgumentTypeError(f"expected two job counts, the first smaller and above 0, got {value!r}")
    return small, large


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=job_counts, default=(2000, 6000), help="the two backlogs each side drains")
    parser.add_argument("--child", nargs=4, metavar=("MODE", "NATS_URL", "REDIS_URL", "JOBS"), help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        mode, nats_url, redis_url, jobs = args.child
        child(mode, nats_url, redis_url, int(jobs))
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("bench_instructions needs valgrind and callgrind_control (Debian: apt-get install valgrind)")
    with tempfile.TemporaryDirectory(prefix="fleet-instructions-") as tmp:
        tree = Path(tmp) / "filing"
        tree.mkdir()
        missing = bc.export_tree(bc.FILING_COMMIT, tree)
        if missing is not None:
            print(f"note: {TITLES['filing']} is not counted: {missing}")
        measure(args, None if missing else tree, Path(tmp))


if __name__ == "__main__":
    main()
