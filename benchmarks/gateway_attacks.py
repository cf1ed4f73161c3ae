"""The small requests of issue 26 item 3 that once stalled a gateway, each sent several times to a real
``fleet gateway`` and ``fleet worker --model echo`` on NATS + Redis, while a thread polls ``/healthz`` every 5 ms.

For each attack it prints the status codes, the request's latency (median and worst) and ``/healthz``'s worst
latency while the attack was in flight. The two settle attacks (a later step's expression, evaluated in the worker's
settle hook) are timed from the run's start to its end (``GET /v1/runs/{id}?wait=``).

    PYTHONPATH=. python -m benchmarks.gateway_attacks [--repeat 3] [--label mine]

Run against another checkout with that checkout first on ``PYTHONPATH`` (the processes run the code of the
checkout that holds ``tests/``; copy this file and ``tests/health_probe.py`` there):
``cd /tmp/orig && PYTHONPATH=. python -m benchmarks.gateway_attacks --label orig``. Results go to
``benchmarks/results/gateway_attacks-<label>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.bench_dag import GatewayFleet
from benchmarks.common import RESULTS_DIR, record, services, write_result
from tests.health_probe import HealthProbe

YAML = {"content-type": "application/yaml"}
TEN = "[*].[@,@,@,@,@,@,@,@,@,@] | []"


def multiplying(root: str, levels: int = 6) -> str:
    """``length(<root>[*].[@ x10] | [] | [*].[@ x10] | [] ...)``: 10^levels values from a list of ten."""
    return "${length(" + root + " | ".join([TEN] * levels) + ")}"


def one_step(name: str, expression: str) -> str:
    steps = f'steps:\n  - id: s\n    model: echo\n    input: {{n: "{expression}"}}\n'
    return f'name: {name}\n{steps}output: "${{steps.s.output}}"\n'


def two_steps(name: str, expression: str) -> str:
    return (
        f'name: {name}\nsteps:\n  - id: a\n    model: echo\n    input: {{l: "${{input.l}}"}}\n'
        f'  - id: b\n    model: echo\n    input: {{n: "{expression}"}}\noutput: "${{steps.b.output}}"\n'
    )


@dataclass
class Attack:
    name: str
    send: Callable[[httpx.AsyncClient], Any]  # -> (status, seconds)
    results: list[tuple[int, float, float]] = field(default_factory=list)  # (status, latency_s, healthz_worst_s)


def _name() -> str:
    return f"atk-{uuid.uuid4().hex[:10]}"


async def post_spec(http: httpx.AsyncClient, text: str) -> tuple[int, float]:
    start = time.monotonic()
    response = await http.post("/v1/dags", content=text.encode(), headers=YAML)
    return response.status_code, time.monotonic() - start


def spec_attack(build: Callable[[str], str]) -> Callable[[httpx.AsyncClient], Any]:
    async def send(http: httpx.AsyncClient) -> tuple[int, float]:
        return await post_spec(http, build(_name()))

    return send


async def run_start(http: httpx.AsyncClient) -> tuple[int, float]:
    name = _name()
    status, _ = await post_spec(http, one_step(name, multiplying("input.l")))
    if status != 201:
        return status, 0.0
    start = time.monotonic()
    response = await http.post(f"/v1/dags/{name}/runs", json={"input": {"l": list(range(10))}})
    return response.status_code, time.monotonic() - start


async def settle(http: httpx.AsyncClient) -> tuple[int, float]:
    """The run's start to its end: the expression is the second step's, evaluated by the worker's settle hook."""
    name = _name()
    status, _ = await post_spec(http, two_steps(name, multiplying("steps.a.output.l")))
    if status != 201:
        return status, 0.0
    start = time.monotonic()
    started = await http.post(f"/v1/dags/{name}/runs", json={"input": {"l": list(range(10))}})
    if started.status_code != 202:
        return started.status_code, time.monotonic() - start
    view = await http.get(f"/v1/runs/{started.json()['run_id']}", params={"wait": 60})
    state = view.json().get("state") if view.status_code == 200 else view.status_code
    print(f"    settle run ended {state!r}: {str(view.json().get('error'))[:120]}")
    return view.status_code, time.monotonic() - start


ATTACKS = [
    Attack("YAML [ x500", spec_attack(lambda n: "[" * 500 + "]" * 500)),
    Attack("YAML [ x10,000", spec_attack(lambda n: "[" * 10_000 + "]" * 10_000)),
    Attack("JMESPath ( x5,000", spec_attack(lambda n: one_step(n, "${" + "(" * 5000 + "input" + ")" * 5000 + "}"))),
    Attack("JMESPath ! x5,000", spec_attack(lambda n: one_step(n, "${" + "!" * 5000 + "input}"))),
    Attack("JMESPath [ x3,000", spec_attack(lambda n: one_step(n, "${" + "[" * 3000 + "input" + "]" * 3000 + "}"))),
    Attack("200 KB ${input.a.a...}", spec_attack(lambda n: one_step(n, "${input" + ".a" * 100_000 + "}"))),
    Attack("10^7-value projection, run start", run_start),
    Attack("10^7-value projection, settle hook", settle),
]


async def measure(url: str, repeat: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        with HealthProbe(url) as probe:
            await post_spec(http, one_step(_name(), "${input.warm}"))  # the first spec imports and starts threads
            for attack in ATTACKS:
                for _ in range(repeat):
                    probe.settle()
                    since = time.monotonic()
                    status, seconds = await attack.send(http)
                    probe.settle()
                    attack.results.append((status, seconds, probe.worst(since)))
                    worst = probe.worst(since)
                    print(f"  {attack.name}: {status} in {seconds * 1000:.0f} ms, /healthz worst {worst * 1000:.0f} ms")


def table(attacks: list[Attack]) -> str:
    lines = [
        "| attack | status | request median | request worst | /healthz worst |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for a in attacks:
        statuses = ",".join(str(s) for s in sorted({r[0] for r in a.results}))
        latencies = [r[1] for r in a.results]
        median, worst = statistics.median(latencies) * 1000, max(latencies) * 1000
        health = max(r[2] for r in a.results) * 1000
        lines.append(f"| {a.name} | {statuses} | {median:,.0f} ms | {worst:,.0f} ms | {health:,.0f} ms |")
    record(
        "each attack: status, request median / worst, /healthz worst while in flight",
        [(a.name, row.split(" | ", 1)[1].rstrip(" |"), "") for a, row in zip(attacks, lines[2:], strict=True)],
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="times each attack is sent")
    parser.add_argument("--label", default="current", help="names the results file")
    args = parser.parse_args()
    with services() as urls, GatewayFleet(urls, 2, RESULTS_DIR / "gateway-attacks-logs") as fleet:
        asyncio.run(fleet.ready())
        asyncio.run(measure(fleet.url, args.repeat))
    print(table(ATTACKS))
    rows = [{"attack": a.name, "results": [list(r) for r in a.results]} for a in ATTACKS]
    path = write_result(f"gateway_attacks-{args.label}", {"repeat": args.repeat, "attacks": rows})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
