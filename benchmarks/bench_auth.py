"""What API keys and rate limits cost the gateway: submit throughput with ``FLEET_AUTH=keys`` and per-tenant
limits on, against ``FLEET_AUTH=off`` with no limits.

    python -m benchmarks.bench_auth [--jobs N] [--rounds 3] [--concurrency 32]

Two real ``fleet gateway`` processes and one real ``fleet worker --model echo`` run on NATS + Redis. The ``on``
gateway has keys, a rate limit (``FLEET_RATE_LIMIT``) and a queued-job quota (``FLEET_TENANT_MAX_QUEUED``), both
set far above what the run reaches so that nothing is refused: every submit pays the limit script's round trip
and the worker the release of each batch, which is what is measured. The ``off`` gateway has neither keys nor
limits. A client in this process (the SDK, ``FleetClient``; with a submitter key for the keyed gateway) submits
``--jobs`` echo jobs (``POST /v1/jobs``) with ``--concurrency`` in flight; the rate is submits per second (each
answered 202 once the broker has the request). Rounds alternate between the two gateways (interleaved, in one
run); the best round of each is compared. The target of issue 13: on >= 0.9 of off.

Services come from FLEET_BENCH_{NATS,REDIS}_URL or are started as in the tests. Writes
``benchmarks/results/bench_auth.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from benchmarks.bench_dashboard import wait_ready
from benchmarks.common import RESULTS_DIR, best_of, services, show, stop_processes, write_result
from fleet.producers.sdk import FleetClient
from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.bundle import Stores
from tests.processes import fleet_argv, fleet_env
from tests.services import die_with_parent, free_port

LOG_DIR = RESULTS_DIR / "bench_auth_logs"
TARGET_RATIO = 0.9
# Limits no run reaches: every submit is checked and counted, none is refused.
LIMITS = {"FLEET_RATE_LIMIT": "1000000/s burst 1000000", "FLEET_TENANT_MAX_QUEUED": "100000000"}
MODES = {"off": {"FLEET_AUTH": "off"}, "on": {"FLEET_AUTH": "keys", **LIMITS}}


async def make_key(redis_url: str) -> str:
    store = make_store(FleetSettings(store_url=redis_url))
    await store.connect()
    try:
        key, _ = await Stores.beside(store).keys.create("bench", "submitter", None)
        return key
    finally:
        await store.close()


@contextlib.contextmanager
def fleet(urls: dict[str, str], ports: dict[str, int]) -> Iterator[dict[str, str]]:
    """An echo worker and one gateway per auth mode, as processes; yields {mode: URL} once each sees a worker."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    base_env = {"FLEET_BROKER_URL": urls["nats"], "FLEET_STORE_URL": urls["redis"], "FLEET_MODELS": "echo"}
    base_env["FLEET_LOG_LEVEL"] = "WARNING"
    runs = [("worker", ["worker", "--model", "echo"], LIMITS)]  # it releases the quota's places as it settles
    runs += [(f"gateway-{mode}", ["gateway"], {**MODES[mode], "FLEET_PORT": str(port)}) for mode, port in ports.items()]
    procs = []
    try:
        for name, args, extra in runs:
            with (LOG_DIR / f"{name}.log").open("wb") as out:
                env = fleet_env(**base_env, **extra)
                procs.append(
                    subprocess.Popen(
                        fleet_argv(*args), env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
                    )
                )
        bases = {mode: f"http://127.0.0.1:{port}" for mode, port in ports.items()}
        for base in bases.values():
            wait_ready(base, procs, timeout_s=300)  # a loaded machine imports slowly
        yield bases
    finally:
        stop_processes(procs)


async def submit_rate(base: str, jobs: int, concurrency: int, api_key: str | None) -> float:
    """Submits per second with ``concurrency`` in flight."""
    run = uuid.uuid4().hex[:8]
    async with FleetClient(base, timeout_s=30, api_key=api_key) as client:
        pending = iter(range(jobs))

        async def one_at_a_time() -> None:
            for i in pending:
                await client.submit("echo", {"i": i}, job_id=f"auth-{run}-{i}")

        started = time.perf_counter()
        await asyncio.gather(*(one_at_a_time() for _ in range(concurrency)))
        return jobs / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"off": [], "on": []}
    with services() as urls:
        key = asyncio.run(make_key(urls["redis"]))
        with fleet(urls, {"off": free_port(), "on": free_port()}) as bases:
            keys_of = {"off": None, "on": key}
            for mode in rates:  # warm up: connections, imports
                asyncio.run(submit_rate(bases[mode], min(300, args.jobs), args.concurrency, keys_of[mode]))
            for _ in range(args.rounds):
                for mode in rates:
                    rates[mode].append(
                        asyncio.run(submit_rate(bases[mode], args.jobs, args.concurrency, keys_of[mode]))
                    )
    off, keys = best_of(rates["off"]), best_of(rates["on"])
    results = {
        "jobs": args.jobs,
        "concurrency": args.concurrency,
        "off_submits_per_s": rates["off"],
        "on_submits_per_s": rates["on"],
        "best_off": off,
        "best_on": keys,
        "ratio_on_over_off": keys / off,
        "median_ratio": statistics.median(rates["on"]) / statistics.median(rates["off"]),
        "limits": LIMITS,
        "target_ratio": TARGET_RATIO,
    }
    path = write_result("bench_auth", results, args.out)
    show(
        "gateway submit throughput with API keys and rate limits on and off (NATS + Redis, echo)",
        [
            ("off: no keys, no limits (best of rounds)", f"{off:.0f} submits/s", ""),
            ("on: keys + rate limit + quota (best of rounds)", f"{keys:.0f} submits/s", ""),
            ("ratio on / off", f"{keys / off:.3f}", f">= {TARGET_RATIO:.2f}"),
            ("ratio of the medians", f"{results['median_ratio']:.3f}", ""),
        ],
    )
    print(f"all rounds: off {[round(r) for r in rates['off']]}, on {[round(r) for r in rates['on']]}; {path}")


if __name__ == "__main__":
    main()
