"""DAG runs against the same jobs driven by a client, over NATS JetStream + Redis, one run.

    python -m benchmarks.bench_dag [--chains 60] [--fanouts 15] [--items 64]

Both sides use the same setup: one in-process ``Worker`` of a private ``echo`` model with the DAG settle hook
(``DagRunner.on_settled``, a no-op for jobs outside a DAG), on real NATS and Redis (``benchmarks.common.services``).
The client side talks to the broker and the store directly, like the DAG runner does (no gateway on either side).

* (a) chain latency: a 5-step echo chain run as a DAG (``DagRunner.start`` then ``wait``), against the same 5 jobs
  chained by a client: publish job 1, ``store.wait`` for its record, publish job 2 with its output, ... Interleaved,
  one at a time; p50 / p99 of each. Target: DAG p50 <= 0.6 x client chain p50.
* (b) fan-out throughput: runs per second of a ``for_each`` over 64 items + a join (one run at a time),
  against 64 independent echo jobs published at once and all waited for. Target: DAG >= 0.8 x independent jobs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from typing import Any

from benchmarks.common import Timer, percentiles_ms, services, show, write_results
from consumers.handlers import with_name
from consumers.handlers.echo import EchoHandler
from consumers.worker import Worker
from dags.runner import DagRunner
from fleet import constants as c
from fleet.brokers import make_broker
from fleet.brokers.base import Broker
from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.base import ResultStore
from fleet.store.dagstore import make_dag_store
from schemas.wire import RequestMessage

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


async def measure(settings: FleetSettings, args: argparse.Namespace) -> dict[str, Any]:
    broker, store = make_broker(settings), make_store(settings)
    await broker.connect()
    await store.connect()
    model = f"echo-{uuid.uuid4().hex[:8]}"
    handler = with_name(EchoHandler, model)()
    runner = DagRunner(broker, store, make_dag_store(store), {model: handler.spec})
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


async def main(args: argparse.Namespace) -> None:
    with services(nats=True, redis=True) as urls:
        settings = FleetSettings(broker_url=urls["nats"], store_url=urls["redis"], max_wait_ms=args.max_wait_ms)
        result = await measure(settings, args)
    a, b = result["a_chain"], result["b_fanout"]
    show(
        "DAG runs vs client-driven jobs, NATS JetStream + Redis, one in-process echo worker",
        [
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
            ("(a) DAG p50 / client p50", f"{a['p50_ratio']:.2f}", "<= 0.6"),
            (f"(b) fan-out of {b['items']} + join: DAG runs/s", f"{b['dag_runs_per_s']:.2f}", ""),
            (f"(b) {b['items']} independent jobs at once: runs/s", f"{b['independent_runs_per_s']:.2f}", ""),
            ("(b) DAG / independent", f"{b['ratio']:.2f}", ">= 0.8"),
        ],
    )
    print(json.dumps(result))
    result["params"] = vars(args)
    print(f"wrote {write_results('dag', result)}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chains", type=int, default=60, help="chain runs of each side (interleaved)")
    parser.add_argument("--fanouts", type=int, default=15, help="fan-out runs of each side (interleaved)")
    parser.add_argument("--items", type=int, default=64, help="items of a fan-out")
    parser.add_argument("--max-wait-ms", type=float, default=2.0, help="the worker's micro-batch wait")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
