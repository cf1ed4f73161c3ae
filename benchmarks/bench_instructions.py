"""Instructions per job of a zero-cost ``embed`` worker: today against Fleet at filing, counted by callgrind.

    python -m benchmarks.bench_instructions [--jobs 2000,6000]

``bench_compact`` times the same worker, and on a shared two-core machine its jobs/s move by a third from run to
run (other tenants' load, the servers sharing the cores). This benchmark counts instead of timing: the worker
process runs under ``valgrind --tool=callgrind --instr-atstart=no``, and instructions are counted only from the
worker's start to the last terminal record (``compact_baseline.callgrind_window``), the same window on both sides.
Callgrind counts the same instructions for the same work whatever else the machine does. Each side drains two
backlogs (``--jobs``, default 2,000 and 6,000 prefilled requests); the difference of the two counts divided by the
difference of the jobs is the cost of one more job, without the worker's start and stop. The NATS and Redis
servers run outside valgrind: their work is not counted (``bench_compact`` reports Redis's CPU per result).

* ``base64``: today's worker, ``encoding_format: base64`` (``bench_compact``'s ``base64`` run);
* ``float``: today's worker, float outputs;
* ``float, at filing``: Fleet at ``bench_compact.FILING_COMMIT``, as ``bench_compact`` runs it (``git archive``).

Instructions are not time (a cache miss costs more than an add), so the jobs/s ratios of ``bench_compact`` stay the
measure of the issue's targets; this one says how much work per job went away, repeatably. Needs valgrind
(Debian's ``valgrind``). Under valgrind a worker runs about 50 times slower: about four minutes in all.
Writes ``benchmarks/results/instructions.json``.
"""

from __future__ import annotations

import argparse
import asyncio
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
from benchmarks.common import services, show, write_results
from benchmarks.compact_baseline import CALLGRIND_ENV

SIDES = ("base64", "float", "filing")
TITLES = {"base64": "base64, today", "float": "float, today", "filing": f"float, at filing ({bc.FILING_COMMIT})"}


def totals(out_file: Path) -> int:
    """The instructions a callgrind output file counted (its ``totals:`` line)."""
    for line in out_file.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"{out_file} has no totals line: did callgrind finish?")


def run_counted(argv: list[str], cwd: Path, pythonpath: Path, out_file: Path) -> dict[str, Any]:
    """``argv`` (a Python command printing one JSON line last) under callgrind; its JSON and the instructions."""
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out_file}", *argv]
    env = {**os.environ, "PYTHONPATH": str(pythonpath), CALLGRIND_ENV: "1"}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])}... under callgrind failed:\n{done.stderr[-2000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "instructions": totals(out_file)}


def child(mode: str, nats_url: str, redis_url: str, jobs: int) -> None:
    """One ``bench_compact`` run of ``mode`` in this process (the side ``run_counted`` starts under callgrind)."""

    async def main() -> dict[str, Any]:
        redis = aioredis.Redis.from_url(redis_url)
        try:
            args = argparse.Namespace(jobs=jobs, batch=64, max_wait_ms=2.0)
            return await bc.one_run(mode, {"nats": nats_url, "redis": redis_url}, args, redis)
        finally:
            await redis.aclose()

    print(json.dumps(asyncio.run(main())))


def measure(args: argparse.Namespace, tree: Path | None, tmp: Path) -> None:
    small, large = args.jobs
    sides = [side for side in SIDES if side != "filing" or tree is not None]
    counts: dict[str, dict[int, int]] = {side: {} for side in sides}
    with services(nats=True, redis=True) as urls:
        for side in sides:
            for jobs in (small, large):
                out_file = tmp / f"callgrind.{side}.{jobs}.out"
                if side == "filing":
                    assert tree is not None
                    argv = [sys.executable, "compact_baseline.py", urls["nats"], urls["redis"], str(jobs), "64", "2.0"]
                    result = run_counted(argv, tree, tree, out_file)
                else:
                    argv = [sys.executable, "-m", "benchmarks.bench_instructions", "--child", side]
                    argv += [urls["nats"], urls["redis"], str(jobs)]
                    result = run_counted(argv, bc.REPO, bc.REPO, out_file)
                counts[side][jobs] = result["instructions"]
                print(f"  {TITLES[side]}, {jobs:,} jobs: {result['instructions']:,} instructions", flush=True)
    per_job = {side: (c[large] - c[small]) / (large - small) for side, c in counts.items()}
    rows = [(f"{TITLES[s]}: instructions / job", f"{per_job[s]:,.0f}", "") for s in sides]
    ratios: dict[str, float] = {"float_over_base64": per_job["float"] / per_job["base64"]}
    if "filing" in per_job:
        ratios["filing_over_base64"] = per_job["filing"] / per_job["base64"]
        ratios["filing_over_float"] = per_job["filing"] / per_job["float"]
        rows += [
            ("ratio at filing / base64 (work per job gone)", f"{ratios['filing_over_base64']:.2f}", ""),
            ("ratio at filing / float", f"{ratios['filing_over_float']:.2f}", ""),
        ]
    rows.append(("ratio float / base64", f"{ratios['float_over_base64']:.2f}", ""))
    show(f"Worker instructions per job, callgrind ({small:,} and {large:,} jobs a side)", rows)
    results = {"counts": counts, "instructions_per_job": per_job, "ratios": ratios, "params": vars(args)}
    print(json.dumps({"instructions_per_job": per_job, "ratios": ratios}))
    print(f"wrote {write_results('instructions', results)}")


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
