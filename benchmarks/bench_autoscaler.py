"""The autoscaler on the process backend (real ``fleet worker`` processes) over NATS JetStream and Redis, under a
step load and a sawtooth load of ``sleep`` jobs (a fixed service time per job, so one worker's capacity is known).

    python -m benchmarks.bench_autoscaler [--service-ms 100] [--max-replicas 4] [--step-rate 25] [--step-s 20]

For each load it reports:

* **lag spike -> scale-out decision**: from the first lag reading above ``--spike-lag`` to the first decision that
  adds workers (the backend's ``set_replicas`` call), in seconds (negative: the rising arrival rate made it add
  workers before the lag got there);
* **backlog drain**: from the lag's peak until only in-flight work is left (lag <= max replicas);
* **replica-seconds** used from the start of the load until the fleet is back at min replicas, against a fleet
  fixed at ``--max-replicas`` for the same time;
* **scale changes** and **reversals** (a change in the opposite direction of the previous one: flapping shows here);
* jobs published, succeeded and computed (heartbeat counters): none lost, none computed twice.

Services come from FLEET_BENCH_NATS_URL / FLEET_BENCH_REDIS_URL or are started locally as in the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import services, show, write_result
from fleet import constants as c
from fleet.autoscaler.backends.process import ProcessBackend
from fleet.autoscaler.config import ScalingConfig
from fleet.autoscaler.service import Autoscaler
from fleet.brokers.base import Broker
from fleet.consumers.handlers import ModelHandler, with_name
from fleet.consumers.handlers.sleep import SleepHandler
from fleet.scaling import RedisScalingStore
from fleet.schemas.wire import Heartbeat, RequestMessage
from fleet.settings import FleetSettings
from tests.infra import connected_pair

SAMPLE_S = 0.1


def __getattr__(name: str) -> type[ModelHandler[Any, Any]]:
    """``benchmarks.bench_autoscaler:sleep_<token>``: the sleep handler as model ``sleep-<token>`` (one per run)."""
    base, sep, token = name.partition("_")
    if base == "sleep" and sep:
        return with_name(SleepHandler, f"sleep-{token}")
    raise AttributeError(name)


# -- loads: a rate (jobs/s) per one-second slot ---------------------------------------------------------------
def step_load(rate: float, seconds: int, idle_s: int) -> list[float]:
    return [0.0] * idle_s + [rate] * seconds


def sawtooth_load(peak: float, period_s: int, periods: int) -> list[float]:
    return [peak * (s + 1) / period_s for _ in range(periods) for s in range(period_s)]


# -- instrumentation ------------------------------------------------------------------------------------------
class Recording(ProcessBackend):
    """The process backend, noting when each change was asked for (the moment of the decision)."""

    def __init__(self, settings: FleetSettings, log_dir: Path) -> None:
        super().__init__(settings, log_dir=log_dir)
        self.changes: list[tuple[float, int, int]] = []  # (monotonic s, from, to)

    async def set_replicas(self, model: str, replicas: int) -> None:
        before = await self.current_replicas(model)
        await super().set_replicas(model, replicas)
        self.changes.append((time.monotonic(), before, replicas))


@dataclass
class Samples:
    lag: list[tuple[float, int]] = field(default_factory=list)
    replicas: list[tuple[float, int]] = field(default_factory=list)
    items: dict[str, int] = field(default_factory=dict)  # worker -> latest items counter


async def sample(broker: Broker, backend: Recording, model: str, out: Samples) -> None:
    while True:
        now = time.monotonic()
        with contextlib.suppress(Exception):
            out.lag.append((now, await broker.lag(c.request_subject(model), c.consumer_name(model))))
        out.replicas.append((now, await backend.current_replicas(model)))
        await asyncio.sleep(SAMPLE_S)


async def tally(broker: Broker, model: str, out: Samples) -> None:
    events = await broker.listen(c.heartbeat_subject(model))
    try:
        async for _, data in events:
            hb = Heartbeat.model_validate_json(data)
            out.items[hb.worker_id] = max(out.items.get(hb.worker_id, 0), hb.items)
    finally:
        await events.close()


async def publish_load(broker: Broker, model: str, load: list[float], service_ms: float) -> list[str]:
    """Publish at the given rate per one-second slot, evenly spaced within each slot."""
    ids: list[str] = []
    start = time.monotonic()
    for slot, rate in enumerate(load):
        count = round(rate)
        for i in range(count):
            due = start + slot + i / count
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            job_id = uuid.uuid4().hex
            message = RequestMessage(job_id=job_id, model=model, input={"mean_ms": service_ms})
            await broker.publish(c.request_subject(model), message.model_dump_json().encode(), msg_id=job_id)
            ids.append(job_id)
    await asyncio.sleep(max(0.0, start + len(load) - time.monotonic()))
    return ids


# -- one run --------------------------------------------------------------------------------------------------
async def until(check: Any, timeout_s: float, poll_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(poll_s)
    return False


async def run_load(name: str, load: list[float], urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    token = uuid.uuid4().hex[:8]
    model = f"sleep-{token}"
    settings = FleetSettings(
        broker_url=urls["nats"],
        store_url=urls["redis"],
        models=[f"benchmarks.bench_autoscaler:sleep_{token}"],  # importable by the worker processes
        heartbeat_interval_s=args.heartbeat_s,
        ack_wait_s=30,
        drain_timeout_s=10,
        log_level="WARNING",
    )
    config = ScalingConfig(
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_drain_s=args.target_drain_s,
        scale_down_stabilization_s=args.stabilization_s,
        predictive_horizon_s=args.predictive_horizon_s,
    )
    samples = Samples()
    with tempfile.TemporaryDirectory(prefix="fleet-bench-autoscaler-") as tmp:
        backend = Recording(settings, Path(tmp))
        scaling = RedisScalingStore(urls["redis"], lock_key=f"fleet:scale:_lock-bench-{token}")
        await scaling.connect()
        async with connected_pair(settings) as (broker, store):
            await broker.ensure_model(model)
            autoscaler = Autoscaler(
                broker, scaling, backend, {model: config}, args.interval_s, f"bench-{name}",
                heartbeat_interval_s=args.heartbeat_s,
            )  # fmt: skip
            async with autoscaler:
                ready = lambda: _live(autoscaler, model, args.min_replicas)  # noqa: E731
                if not await until(ready, 120):
                    raise SystemExit(f"{name}: the first {args.min_replicas} worker(s) did not start; see {tmp}")
                tasks = [asyncio.create_task(sample(broker, backend, model, samples))]
                tasks.append(asyncio.create_task(tally(broker, model, samples)))
                start = time.monotonic()
                ids = await publish_load(broker, model, load, args.service_ms)
                load_end = time.monotonic()
                records = await asyncio.gather(*(store.wait(job_id, 300) for job_id in ids))
                done_at = time.monotonic()
                back = lambda: _replicas(backend, model, args.min_replicas)  # noqa: E731
                await until(back, args.stabilization_s + 60)
                await asyncio.sleep(2 * args.heartbeat_s)  # the last heartbeats of drained workers
                end = time.monotonic()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        await scaling.close()
    succeeded = sum(1 for r in records if r is not None and r.state == "succeeded")
    timing = {"start": start, "load_end": load_end, "done_at": done_at, "end": end}
    return summarize(name, load, ids, succeeded, samples, backend.changes, timing, args)


async def _live(autoscaler: Autoscaler, model: str, n: int) -> bool:
    return autoscaler.signals.live_workers(model) >= n and await autoscaler.backend.current_replicas(model) >= n


async def _replicas(backend: Recording, model: str, n: int) -> bool:
    return await backend.current_replicas(model) <= n and not backend.draining(model)


# -- figures --------------------------------------------------------------------------------------------------
def replica_seconds(replicas: list[tuple[float, int]], start: float, end: float) -> float:
    total = 0.0
    points = [(t, n) for t, n in replicas if start <= t <= end]
    for (t0, n), (t1, _) in itertools.pairwise(points):
        total += n * (t1 - t0)
    return total


def reversals(changes: list[tuple[float, int, int]]) -> int:
    directions = [1 if after > before else -1 for _, before, after in changes if after != before]
    return sum(1 for a, b in itertools.pairwise(directions) if a != b)


def spike_to_scale_out(
    samples: Samples, changes: list[tuple[float, int, int]], start: float, spike_lag: int
) -> float | None:
    """Seconds from the first lag reading above ``spike_lag`` to the first scale-out; negative when the arrival rate
    made the autoscaler add workers before the lag got there."""
    spike = next((t for t, lag in samples.lag if t >= start and lag > spike_lag), None)
    out = next((t for t, before, after in changes if after > before), None)
    return None if spike is None or out is None else out - spike


def drain_after_peak(samples: Samples, start: float, drained_lag: int) -> tuple[int, float | None]:
    during = [(t, lag) for t, lag in samples.lag if t >= start]
    if not during:
        return 0, None
    peak_t, peak = max(during, key=lambda p: p[1])
    drained = next((t for t, lag in during if t > peak_t and lag <= drained_lag), None)
    return peak, None if drained is None else drained - peak_t


def summarize(
    name: str,
    load: list[float],
    ids: list[str],
    succeeded: int,
    samples: Samples,
    changes: list[tuple[float, int, int]],
    timing: dict[str, float],
    args: argparse.Namespace,
) -> dict[str, Any]:
    start, end = timing["start"], timing["end"]
    changes = [ch for ch in changes if ch[0] >= start]
    used = replica_seconds(samples.replicas, start, end)
    fixed = args.max_replicas * (end - start)
    peak, drain_s = drain_after_peak(samples, start, args.max_replicas)
    return {
        "load": name,
        "rate_per_s": {"mean": sum(load) / len(load), "max": max(load)},
        "capacity_per_replica_per_s": 1000 / args.service_ms,
        "seconds": {
            "load": timing["load_end"] - start,
            "to_last_result": timing["done_at"] - start,
            "run": end - start,
        },
        "spike_to_scale_out_s": spike_to_scale_out(samples, changes, start, args.spike_lag),
        "peak_lag": peak,
        "drain_after_peak_s": drain_s,
        "replica_seconds": used,
        "replica_seconds_fixed_at_max": fixed,
        "replica_seconds_ratio": used / fixed if fixed else None,
        "max_replicas_used": max((n for _, n in samples.replicas), default=0),
        "scale_changes": len(changes),
        "reversals": reversals(changes),
        "changes": [(round(t - start, 2), before, after) for t, before, after in changes],
        "jobs": {"published": len(ids), "succeeded": succeeded, "computed": sum(samples.items.values())},
    }


def rows_for(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    name, jobs = result["load"], result["jobs"]
    spike = result["spike_to_scale_out_s"]
    drain = result["drain_after_peak_s"]
    return [
        (f"{name}: lag spike -> scale-out decision", "n/a" if spike is None else f"{spike:.1f} s", "a few intervals"),
        (
            f"{name}: backlog drain after the lag peak ({result['peak_lag']})",
            "n/a" if drain is None else f"{drain:.1f} s",
            "",
        ),
        (
            f"{name}: replica-seconds vs fixed at max",
            f"{result['replica_seconds']:.0f} / {result['replica_seconds_fixed_at_max']:.0f} "
            f"({100 * result['replica_seconds_ratio']:.0f} %)",
            "< 100 %",
        ),
        (
            f"{name}: scale changes (reversals)",
            f"{result['scale_changes']} ({result['reversals']})",
            "few, no flapping",
        ),
        (
            f"{name}: jobs published / succeeded / computed",
            f"{jobs['published']} / {jobs['succeeded']} / {jobs['computed']}",
            "all equal",
        ),
    ]


async def main(args: argparse.Namespace) -> None:
    loads = {
        "step": step_load(args.step_rate, args.step_s, idle_s=2),
        "sawtooth": sawtooth_load(args.saw_peak, args.saw_period_s, args.saw_periods),
    }
    results: dict[str, Any] = {}
    with services(nats=True, redis=True) as urls:
        for name in args.loads:
            results[name] = await run_load(name, loads[name], urls, args)
    rows = [row for name in args.loads for row in rows_for(results[name])]
    show("Autoscaler on the process backend, NATS JetStream + Redis", rows)
    results["params"] = vars(args)
    print(f"wrote {write_result('autoscaler', results)}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loads", type=lambda v: v.split(","), default=["step", "sawtooth"])
    parser.add_argument(
        "--service-ms", type=float, default=100.0, help="sleep per job: one worker does 1000/this per s"
    )
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--max-replicas", type=int, default=4)
    parser.add_argument("--target-drain-s", type=float, default=10.0)
    parser.add_argument("--stabilization-s", type=float, default=15.0)
    parser.add_argument("--predictive-horizon-s", type=float, default=None)
    parser.add_argument("--interval-s", type=float, default=0.5)
    parser.add_argument("--heartbeat-s", type=float, default=0.5)
    parser.add_argument("--step-rate", type=float, default=25.0, help="jobs/s of the step")
    parser.add_argument("--step-s", type=int, default=20)
    parser.add_argument("--saw-peak", type=float, default=30.0, help="jobs/s at each tooth's top")
    parser.add_argument("--saw-period-s", type=int, default=15)
    parser.add_argument("--saw-periods", type=int, default=3)
    parser.add_argument("--spike-lag", type=int, default=10, help="lag that counts as a spike")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
