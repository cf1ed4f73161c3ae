"""Start-up benchmark: whole ``fleet`` processes, timed from their start to the moment they are of use.

    python -m benchmarks.bench_startup [--runs 5] [--quick] [--baseline CHECKOUT]

Three measures, each the median of ``--runs`` runs (``--quick``: 3):

- ``fleet --help``: the process runs to its exit (target 0.5 s);
- ``fleet worker --model echo`` on NATS and Redis: from the start to its ``/readyz`` answering 200 (target 2 s);
- ``fleet up`` (embedded broker and store, the default models echo, sleep and embed): from the start to the
  gateway's ``/readyz`` answering 200, every model with a warm worker (target 15 s).

Each process is the ``fleet`` command of this environment with the checkout first on ``PYTHONPATH``; readiness
is polled every 20 ms. ``--baseline`` times another checkout's code (an earlier commit's tree) the same way, its
runs interleaved with these, so that both sides see the same machine load. Services come from
FLEET_BENCH_{NATS,REDIS}_URL or are started locally as the tests do. Writes ``benchmarks/results/startup.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import services, show, stop_processes, write_result
from tests.services import free_port

ROOT = Path(__file__).resolve().parent.parent
TARGETS_S = {"fleet --help": 0.5, "fleet worker --model echo": 2.0, "fleet up": 15.0}
POLL_S = 0.02
BASELINE = "baseline: "


def fleet_command() -> list[str]:
    """The ``fleet`` console script beside this interpreter (what a user runs), else ``python -m fleet``."""
    script = Path(sys.executable).parent / "fleet"
    return [str(script)] if script.exists() else [sys.executable, "-m", "fleet"]


def fleet_env(root: Path = ROOT, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update(PYTHONPATH=str(root), **extra)
    return env


def time_help(root: Path = ROOT) -> float:
    start = time.perf_counter()
    subprocess.run([*fleet_command(), "--help"], env=fleet_env(root), capture_output=True, check=True, timeout=60)
    return time.perf_counter() - start


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def time_until_ready(args: list[str], env: dict[str, str], url: str, log: Path, timeout_s: float = 120) -> float:
    """Start ``fleet ARGS``; seconds until ``url`` answers 200. The process is stopped (SIGTERM) afterwards."""
    with log.open("wb") as out:
        start = time.perf_counter()
        proc = subprocess.Popen([*fleet_command(), *args], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        while not ready(url):
            if proc.poll() is not None:
                raise RuntimeError(f"fleet {' '.join(args)} exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
            if time.perf_counter() - start > timeout_s:
                raise RuntimeError(f"fleet {' '.join(args)} not ready in {timeout_s} s:\n{log.read_text()[-2000:]}")
            time.sleep(POLL_S)
        return time.perf_counter() - start
    finally:
        stop_processes([proc])


def time_worker(urls: dict[str, str], log: Path, root: Path = ROOT) -> float:
    port = free_port()
    env = fleet_env(root, FLEET_BROKER_URL=urls["nats"], FLEET_STORE_URL=urls["redis"])
    args = ["worker", "--model", "echo", "--metrics-port", str(port)]
    return time_until_ready(args, env, f"http://127.0.0.1:{port}/readyz", log)


def time_up(log: Path, root: Path = ROOT) -> float:
    port = free_port()
    return time_until_ready(["up", "--port", str(port)], fleet_env(root), f"http://127.0.0.1:{port}/readyz", log)


def medians(runs: int, measures: dict[str, Callable[[], float]]) -> dict[str, dict[str, Any]]:
    """Each measure ``runs`` times, the measures interleaved (a loud moment on a shared machine hits them alike)."""
    seconds: dict[str, list[float]] = {name: [] for name in measures}
    for _ in range(runs):
        for name, measure in measures.items():
            seconds[name].append(measure())
    return {
        name: {
            "median_s": round(statistics.median(values), 3),
            "runs_s": [round(v, 3) for v in values],
            "target_s": TARGETS_S[name.removeprefix(BASELINE)],
            "within_target": statistics.median(values) < TARGETS_S[name.removeprefix(BASELINE)],
        }
        for name, values in seconds.items()
    }


def main(args: argparse.Namespace) -> None:
    runs = 3 if args.quick else args.runs
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    with services(nats=True, redis=True) as urls:
        time_worker(urls, logs / "worker-first.log")  # the first worker creates the model's stream: not timed
        measures: dict[str, Callable[[], float]] = {
            "fleet --help": time_help,
            "fleet worker --model echo": lambda: time_worker(urls, logs / "worker.log"),
            "fleet up": lambda: time_up(logs / "up.log"),
        }
        if args.baseline:
            base = Path(args.baseline).resolve()
            measures |= {
                f"{BASELINE}fleet --help": lambda: time_help(base),
                f"{BASELINE}fleet worker --model echo": lambda: time_worker(urls, logs / "base-worker.log", base),
                f"{BASELINE}fleet up": lambda: time_up(logs / "base-up.log", base),
            }
        results = medians(runs, measures)
    show(
        f"start-up, median of {runs} runs",
        [
            (name, f"{r['median_s']:.2f} s", f"< {r['target_s']:g} s {'ok' if r['within_target'] else 'MISSED'}")
            for name, r in results.items()
        ],
    )
    figures = {
        "runs": runs,
        "baseline": str(Path(args.baseline).resolve()) if args.baseline else None,
        "results": results,
    }
    print(f"wrote {write_result('startup', figures)}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="runs of each measure (the median is reported)")
    parser.add_argument("--quick", action="store_true", help="3 runs")
    parser.add_argument("--baseline", help="another checkout to time the same way, interleaved (e.g. main)")
    parser.add_argument("--logs", default="/tmp/fleet-bench-startup", help="where the processes' output goes")
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
