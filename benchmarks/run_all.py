"""Run every benchmark in ``benchmarks.catalogue``, one process each, and say at the end what ran, what failed, what
was skipped and why, and where the result files are. ``make bench`` runs this.

    python -m benchmarks.run_all                 # everything this machine can run (long: an hour or more)
    python -m benchmarks.run_all --list          # the benchmarks, their commands, and what each needs
    python -m benchmarks.run_all --only dag,priority

A benchmark that needs a GPU or valgrind is skipped, with the reason, where the machine has none. One that fails
does not stop the others; the exit status is 1 when any failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.catalogue import BENCHMARKS, Benchmark, missing

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(slots=True)
class Outcome:
    benchmark: Benchmark
    status: str  # "ok", "failed (exit N)", "ran, wrote no result file", or "skipped: <why>"
    seconds: float = 0.0


def run_one(benchmark: Benchmark) -> Outcome:
    why = missing(benchmark.needs)
    if why is not None:
        return Outcome(benchmark, f"skipped: {why}")
    path = RESULTS_DIR / f"{benchmark.name}.json"
    before = path.stat().st_mtime if path.exists() else None
    print(f"\n==> {benchmark.name}: {benchmark.command}", flush=True)
    started = time.monotonic()
    rc = subprocess.run([sys.executable, "-m", benchmark.module, *benchmark.args]).returncode
    seconds = time.monotonic() - started
    if rc != 0:
        return Outcome(benchmark, f"failed (exit {rc})", seconds)
    written = path.exists() and path.stat().st_mtime != before
    return Outcome(benchmark, "ok" if written else "ran, wrote no result file", seconds)


def summary(outcomes: list[Outcome]) -> str:
    lines = ["", "==> benchmarks: summary"]
    for o in outcomes:
        took = f" in {o.seconds:,.0f} s" if o.seconds else ""
        lines.append(f"  {o.benchmark.name:<24} {o.status}{took}")
    ran = sum(o.status == "ok" for o in outcomes)
    skipped = sum(o.status.startswith("skipped") for o in outcomes)
    failed = len(outcomes) - ran - skipped
    lines.append(f"  {ran} ran, {skipped} skipped, {failed} failed; results in {RESULTS_DIR}")
    lines.append("  the benchmarks page: python -m benchmarks.report")
    return "\n".join(lines)


def select(only: str | None) -> list[Benchmark]:
    if not only:
        return list(BENCHMARKS)
    wanted = [name.strip() for name in only.split(",") if name.strip()]
    known = {b.name: b for b in BENCHMARKS}
    unknown = [name for name in wanted if name not in known]
    if unknown:
        sys.exit(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[name] for name in wanted]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated benchmark names (see --list)")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and what they need, run nothing")
    args = parser.parse_args()
    chosen = select(args.only)
    if args.list:
        for b in chosen:
            why = missing(b.needs)
            print(f"{b.name:<24} {b.command}" + (f"\n{'':<24} skipped here: {why}" if why else ""))
        return 0
    outcomes = [run_one(b) for b in chosen]
    print(summary(outcomes))
    return 1 if any(o.status.startswith(("failed", "ran,")) for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
