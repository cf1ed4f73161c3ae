"""DAG runs against the same jobs driven by a client, over NATS JetStream + Redis, one run.

    python -m benchmarks.bench_dag [--chains 60] [--fanouts 15] [--items 64]

Two setups, each measured side by side (interleaved, so both sides of a ratio see the same noise):

* **gateway** (the targets): a ``fleet gateway`` process and a ``fleet worker --model echo`` process, as a user
  runs them. The client is the SDK (``FleetClient``): the DAG side registers the DAG and calls ``start_run`` then
  ``wait_run``; the client side calls ``submit`` then ``wait`` for each job, feeding each output to the next.
* **direct** (for comparison, no target): one in-process ``Worker`` with the DAG settle hook; the client side talks
  to the broker and the store itself (publish, ``store.wait``), the cheapest client there is, and the DAG side
  calls ``DagRunner.start`` and ``wait``.

What is measured:

* (a) chain latency: a 5-step echo chain as a DAG against the same 5 jobs chained by a client (submit job 1, wait
  for it, submit job 2 with its output, ...), one at a time; p50 / p99 of each. Target: DAG p50 <= 0.6 x client.
* (b) fan-out throughput: runs per second of a ``for_each`` over 64 items + a join (one run at a time), against
  64 independent echo jobs submitted at once and all waited for. Target: DAG >= 0.8 x independent jobs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import (
    RESULTS_DIR,
    Timer,
    percentiles_ms,
    services,
    show,
    stop_processes,
    write_result,
)
from fleet import constants as c
from fleet.brokers import make_broker
from fleet.brokers.base import Broker
from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.worker import Worker
from fleet.dags.runner import DagRunner
from fleet.producers.sdk import FleetClient
from fleet.schemas.wire import RequestMessage
from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.base import ResultStore
from fleet.store.bundle import Stores
from tests.processes import ROOT, fleet_argv, fleet_env
from tests.services import die_with_parent, free_port

CHAIN_STEPS = 5


def chain_spec(name: str, model: str) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"id": "s1", "model": model, "input": {"v": "${input.v}", "hops": 1}}]
    for i in range(2, CHAIN_STEPS + 1):
        prev = f"steps.s{i - 1}.output"
        steps.append(
            {"id": f"s{i}", "model": model, "input": {"v": f"${{{prev}.v}}", "hops": f"${{sum([{prev}.hops, `1`])}}"}}
        )
    return {"name": name, "steps": steps, "output": f"${{steps.s{CHAIN_STEPS}.output}}"}


def fanout_spec(name: str, model: str) -> dict[str, Any]:
    return {
        "name": name,
        "steps": [
            {"id": "each", "model": model, "for_each": "${input.items}", "input": {"item": "${item}"}},
            {"id": "join", "model": model, "input": {"n": "${length(steps.each.outputs)}"}},
        ],
        "output": "${steps.join.output.n}",
    }


async def publish(broker: Broker, model: str, job_id: str, payload: dict[str, Any]) -> None:
    data = RequestMessage(job_id=job_id, model=model, input=payload).model_dump_json().encode()
    await broker.publish(c.request_subject(model), data, msg_id=job_id)


async def client_chain(broker: Broker, store: ResultStore, model: str) -> float:
    """Five jobs chained by a client: each one published after the previous one's record is terminal."""
    prefix = uuid.uuid4().hex
    payload: dict[str, Any] = {"v": 42, "hops": 1}
    with Timer() as t:
        for i in range(1, CHAIN_STEPS + 1):
            job_id = f"{prefix}-{i}"
            await publish(broker, model, job_id, payload)
            record = await store.wait(job_id, 30)
            assert record is not None and record.state == "succeeded", record
            payload = {"v": record.output["v"], "hops": record.output["hops"] + 1}
    assert payload["hops"] == CHAIN_STEPS + 1
    return t.seconds


async def dag_run(runner: DagRunner, name: str, run_input: dict[str, Any], expected: Any) -> float:
    with Timer() as t:
        _, doc = await runner.start(name, run_input)
        doc = await runner.wait(doc["run"]["run_id"], 60)
    view = await runner.view(doc["run"]["run_id"])
    assert view["state"] == "succeeded" and view["output"] == expected, view
    return t.seconds


async def independent_jobs(broker: Broker, store: ResultStore, model: str, items: int) -> float:
    """``items`` echo jobs published at once, then every record waited for."""
    prefix = uuid.uuid4().hex
    ids = [f"{prefix}-{i}" for i in range(items)]
    with Timer() as t:
        await asyncio.gather(*(publish(broker, model, job_id, {"item": i}) for i, job_id in enumerate(ids)))
        records = await asyncio.gather(*(store.wait(job_id, 60) for job_id in ids))
    assert all(r is not None and r.state == "succeeded" for r in records)
    return t.seconds


# -- through the gateway, with the SDK ---------------------------------------------------------------------------
async def sdk_chain(client: FleetClient) -> float:
    """Five jobs chained by an SDK client: submit, wait, submit the next with its output, ..."""
    payload: dict[str, Any] = {"v": 42, "hops": 1}
    with Timer() as t:
        for _ in range(CHAIN_STEPS):
            record = await client.wait(await client.submit("echo", payload), 30)
            assert record.state == "succeeded" and record.output is not None, record
            payload = {"v": record.output["v"], "hops": record.output["hops"] + 1}
    assert payload["hops"] == CHAIN_STEPS + 1
    return t.seconds


async def sdk_run(client: FleetClient, name: str, run_input: dict[str, Any], expected: Any) -> float:
    with Timer() as t:
        view = await client.wait_run(await client.start_run(name, run_input), 60)
    assert view["state"] == "succeeded" and view["output"] == expected, view
    return t.seconds


async def sdk_independent(client: FleetClient, items: int) -> float:
    """``items`` echo jobs submitted at once, then every one waited for."""
    with Timer() as t:
        ids = await asyncio.gather(*(client.submit("echo", {"item": i}) for i in range(items)))
        records = await asyncio.gather(*(client.wait(job_id, 60) for job_id in ids))
    assert all(r.state == "succeeded" for r in records)
    return t.seconds


class GatewayFleet:
    """A ``fleet gateway`` and a ``fleet worker --model echo`` process on the given servers."""

    def __init__(self, urls: dict[str, str], max_wait_ms: float, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {"FLEET_BROKER_URL": urls["nats"], "FLEET_STORE_URL": urls["redis"], "FLEET_MODELS": "echo"}
        env["FLEET_MAX_WAIT_MS"] = str(max_wait_ms)
        self.env, self.log_dir = fleet_env(**env), log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> GatewayFleet:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for name, argv in (
            ("gateway", ["gateway", "--port", str(self.port)]),
            ("worker", ["worker", "--model", "echo"]),
        ):
            with (self.log_dir / f"{name}.log").open("wb") as out:
                self.procs.append(
                    subprocess.Popen(
                        fleet_argv(*argv),
                        env=self.env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        cwd=ROOT,
                        preexec_fn=die_with_parent,
                    )
                )
        return self

    def __exit__(self, *exc: object) -> None:
        stop_processes(self.procs, timeout_s=20)

    async def ready(self, timeout_s: float = 90) -> None:
        """Until the gateway answers /readyz and an echo job runs end to end (the worker is up)."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient() as http:
            while time.monotonic() < deadline:
                if any(p.poll() is not None for p in self.procs):
                    raise RuntimeError(f"a fleet process exited; see the logs in {self.log_dir}")
                try:
                    if (await http.get(f"{self.url}/readyz", timeout=1)).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
            else:
                raise RuntimeError(f"the gateway was not ready within {timeout_s:g}s; see {self.log_dir}")
        async with FleetClient(self.url) as client:
            await client.wait(await client.submit("echo", {"warm": True}), timeout_s)


async def measure_gateway(urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    with GatewayFleet(urls, args.max_wait_ms, RESULTS_DIR / "dag-logs") as fleet:
        await fleet.ready()
        async with FleetClient(fleet.url) as client:
            chain, _ = await client.register_dag(chain_spec("bench-chain", "echo"))
            fan, _ = await client.register_dag(fanout_spec("bench-fan", "echo"))
            items = list(range(args.items))
            for _ in range(3):  # warm both paths
                await sdk_chain(client)
                await sdk_run(client, chain, {"v": 42}, {"v": 42, "hops": CHAIN_STEPS})
            dag_chain, client_chain_s = [], []
            for _ in range(args.chains):
                dag_chain.append(await sdk_run(client, chain, {"v": 42}, {"v": 42, "hops": CHAIN_STEPS}))
                client_chain_s.append(await sdk_chain(client))
            await sdk_run(client, fan, {"items": items}, args.items)
            await sdk_independent(client, args.items)
            dag_fan, plain = [], []
            for _ in range(args.fanouts):
                dag_fan.append(await sdk_run(client, fan, {"items": items}, args.items))
                plain.append(await sdk_independent(client, args.items))
    return summarise(dag_chain, client_chain_s, dag_fan, plain, args)


# -- direct: the broker and the store, no gateway ---------------------------------------------------------------
async def measure(settings: FleetSettings, args: argparse.Namespace) -> dict[str, Any]:
    broker, store = make_broker(settings), make_store(settings)
    await broker.connect()
    await store.connect()
    model = f"echo-{uuid.uuid4().hex[:8]}"
    handler = with_name(EchoHandler, model)()
    runner = DagRunner(broker, store, Stores.beside(store).dags, {model: handler.spec})
    try:
        async with Worker(handler, broker, store, settings=settings, on_settled=[runner.on_settled]):
            chain, _, _ = await runner.register(chain_spec(f"bench-chain-{model}", model))
            fan, _, _ = await runner.register(fanout_spec(f"bench-fan-{model}", model))
            items = list(range(args.items))
            for _ in range(3):  # warm both paths: connections, scripts, subscriptions
                await client_chain(broker, store, model)
                await dag_run(runner, chain, {"v": 42}, {"v": 42, "hops": CHAIN_STEPS})
            dag_chain, client = [], []
            for _ in range(args.chains):  # interleaved, so both sides see the same noise
                dag_chain.append(await dag_run(runner, chain, {"v": 42}, {"v": 42, "hops": CHAIN_STEPS}))
                client.append(await client_chain(broker, store, model))
            dag_fan, plain = [], []
            await dag_run(runner, fan, {"items": items}, args.items)
            await independent_jobs(broker, store, model, args.items)
            for _ in range(args.fanouts):
                dag_fan.append(await dag_run(runner, fan, {"items": items}, args.items))
                plain.append(await independent_jobs(broker, store, model, args.items))
    finally:
        await store.close()
        await broker.close()
    return summarise(dag_chain, client, dag_fan, plain, args)


def summarise(
    dag_chain: list[float], client: list[float], dag_fan: list[float], plain: list[float], args: argparse.Namespace
) -> dict[str, Any]:
    dag_p, client_p = percentiles_ms(dag_chain), percentiles_ms(client)
    dag_rate, plain_rate = len(dag_fan) / sum(dag_fan), len(plain) / sum(plain)
    return {
        "a_chain": {
            "dag": dag_p,
            "client_chain": client_p,
            "p50_ratio": dag_p["p50_ms"] / client_p["p50_ms"],
            "target": 0.6,
            "runs": args.chains,
        },
        "b_fanout": {
            "items": args.items,
            "dag_runs_per_s": dag_rate,
            "independent_runs_per_s": plain_rate,
            "ratio": dag_rate / plain_rate,
            "target": 0.8,
            "runs": args.fanouts,
        },
    }


def rows(result: dict[str, Any], targets: bool) -> list[tuple[str, str, str]]:
    a, b = result["a_chain"], result["b_fanout"]
    return [
        (
            f"(a) {CHAIN_STEPS}-step chain as a DAG: p50 / p99 ms",
            f"{a['dag']['p50_ms']:.1f} / {a['dag']['p99_ms']:.1f}",
            "",
        ),
        (
            f"(a) {CHAIN_STEPS} jobs chained by a client: p50 / p99 ms",
            f"{a['client_chain']['p50_ms']:.1f} / {a['client_chain']['p99_ms']:.1f}",
            "",
        ),
        ("(a) DAG p50 / client p50", f"{a['p50_ratio']:.2f}", "<= 0.6" if targets else ""),
        (f"(b) fan-out of {b['items']} + join: DAG runs/s", f"{b['dag_runs_per_s']:.2f}", ""),
        (f"(b) {b['items']} independent jobs at once: runs/s", f"{b['independent_runs_per_s']:.2f}", ""),
        ("(b) DAG / independent", f"{b['ratio']:.2f}", ">= 0.8" if targets else ""),
    ]


async def main(args: argparse.Namespace) -> None:
    result: dict[str, Any] = {}
    with services(nats=True, redis=True) as urls:
        if args.setup in ("gateway", "both"):
            result["gateway"] = await measure_gateway(urls, args)
        if args.setup in ("direct", "both"):
            settings = FleetSettings(broker_url=urls["nats"], store_url=urls["redis"], max_wait_ms=args.max_wait_ms)
            result["direct"] = await measure(settings, args)
    if "gateway" in result:
        show(
            "DAG runs vs jobs chained by an SDK client: fleet gateway + fleet worker processes, NATS JetStream + Redis",
            rows(result["gateway"], targets=True),
        )
    if "direct" in result:
        show(
            "For comparison, no gateway: an in-process worker, the client on the broker and the store itself",
            rows(result["direct"], targets=False),
        )
    print(json.dumps(result))
    result["params"] = vars(args)
    print(f"wrote {write_result('dag', result)}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chains", type=int, default=60, help="chain runs of each side (interleaved)")
    parser.add_argument("--fanouts", type=int, default=15, help="fan-out runs of each side (interleaved)")
    parser.add_argument("--items", type=int, default=64, help="items of a fan-out")
    parser.add_argument("--max-wait-ms", type=float, default=2.0, help="the worker's micro-batch wait")
    parser.add_argument(
        "--setup", choices=["gateway", "direct", "both"], default="both", help="which setups to measure"
    )
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
