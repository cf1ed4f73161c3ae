"""DAG runs end to end through real workers, one contract suite over memory, NATS + Redis and Kafka + Redis.

Every construct (chain, fan-out, fan-in, branch, skip, retries, ``on_error``, run timeout, cancel) is run by two
in-process workers of one model that continue the runs from their settle hook, as ``fleet worker`` does. Besides
the run's view, each test checks what a user relies on: every step job is terminal exactly once (one winning
terminal write, one done notification on Redis), a join is launched once, a failed run's dependants never run.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest

from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.worker import Worker
from fleet.dags.runner import DagRunner
from fleet.schemas.jobs import JobState
from fleet.schemas.models import BUILTIN_SPECS
from fleet.store.bundle import Stores
from tests.dag_fixtures import fleet_fixture, infra_fixture, settings_fixture  # noqa: F401  (fixtures)
from tests.dagkit import DagFleet, all_job_ids, terminal_once
from tests.infra import eventually

EXAMPLES = Path(__file__).resolve().parent.parent / "dags" / "examples"


def key() -> str:
    return uuid.uuid4().hex[:12]


def chain_spec(name: str, model: str, length: int = 5) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"id": "s1", "model": model, "input": {"v": "${input.v}", "hops": 1}}]
    for i in range(2, length + 1):
        prev = f"steps.s{i - 1}.output"
        steps.append(
            {"id": f"s{i}", "model": model, "input": {"v": f"${{{prev}.v}}", "hops": f"${{sum([{prev}.hops, `1`])}}"}}
        )
    return {"name": name, "steps": steps, "output": f"${{steps.s{length}.output}}"}


def fan_spec(name: str, model: str, **each: Any) -> dict[str, Any]:
    """split -> each (one job per text; ``each`` adds settings) -> join (reads every output)."""
    return {
        "name": name,
        "steps": [
            {"id": "split", "model": model, "input": {"texts": "${input.texts}"}},
            {
                "id": "each",
                "model": model,
                "for_each": "${steps.split.output.texts}",
                "input": {
                    "text": "${item}",
                    "i": "${index}",
                    "key": "${join('-', [input.key, to_string(index)])}",
                    "fail": "${contains(input.bad, index)}",
                },
                **each,
            },
            {
                "id": "join",
                "model": model,
                "input": {
                    "key": "${join('-', [input.key, 'join'])}",
                    "n": "${length(steps.each.outputs)}",
                    "first": "${steps.each.outputs[0].text}",
                    "texts": "${steps.each.outputs[*].text}",
                    "outputs": "${steps.each.outputs}",
                },
            },
        ],
        "output": {"n": "${steps.join.output.n}", "texts": "${steps.join.output.texts}"},
    }


# -- chain ----------------------------------------------------------------------------------------------------
async def test_a_chain_of_five_steps_passes_each_output_on(fleet: DagFleet, unique) -> None:
    view = await fleet.run(chain_spec(f"chain-{unique}", fleet.model), {"v": 42})
    run = view["run_id"]
    jid = await fleet.ids(run)
    assert view["state"] == "succeeded", view
    assert view["output"]["v"] == 42 and view["output"]["hops"] == 5
    assert [view["steps"][f"s{i}"]["job_ids"] for i in range(1, 6)] == [[jid(f"s{i}", 0)] for i in range(1, 6)]
    assert all(step["state"] == "succeeded" for step in view["steps"].values())
    starts = [view["steps"][f"s{i}"]["started_at"] for i in range(1, 6)]
    assert starts == sorted(starts), "each step starts after the one it reads"
    await terminal_once(fleet, all_job_ids(view))
    records = await fleet.store.get_many(all_job_ids(view))
    assert [r.output["hops"] for r in records if r] == [1, 2, 3, 4, 5]


# -- fan-out and fan-in ---------------------------------------------------------------------------------------
async def test_a_fan_out_makes_one_job_per_item_and_the_join_reads_them_all(fleet: DagFleet, unique) -> None:
    k = key()
    texts = [f"t{i}" for i in range(7)]
    view = await fleet.run(fan_spec(f"fan-{unique}", fleet.model), {"texts": texts, "key": k, "bad": []})
    run = view["run_id"]
    jid = await fleet.ids(run)
    assert view["state"] == "succeeded", view
    assert view["steps"]["each"]["job_ids"] == [jid("each", i) for i in range(7)]
    assert view["output"] == {"n": 7, "texts": texts}, "outputs are in item order, whatever the order of arrival"
    join = await fleet.store.get(jid("join", 0))
    assert join is not None and join.output["first"] == "t0"
    assert view["steps"]["join"]["job_ids"] == [jid("join", 0)], "the join is launched once"
    assert fleet.runs_of(f"{k}-join") == 1, "the join is computed once"
    assert all(fleet.runs_of(f"{k}-{i}") == 1 for i in range(7))
    await terminal_once(fleet, all_job_ids(view))


async def test_an_empty_fan_out_succeeds_at_once_and_the_join_sees_no_outputs(fleet: DagFleet, unique) -> None:
    spec = fan_spec(f"empty-{unique}", fleet.model)
    spec["steps"][2]["input"] = {"n": "${length(steps.each.outputs)}"}
    spec["output"] = "${steps.join.output.n}"
    view = await fleet.run(spec, {"texts": [], "key": key(), "bad": []})
    assert view["state"] == "succeeded" and view["output"] == 0
    assert view["steps"]["each"]["job_ids"] == []


# -- branch and skip ------------------------------------------------------------------------------------------
async def test_a_false_when_skips_its_step_and_what_depends_only_on_it(fleet: DagFleet, unique) -> None:
    m = fleet.model
    spec = {
        "name": f"branch-{unique}",
        "steps": [
            {"id": "a", "model": m, "input": {"go": "${input.go}"}},
            {"id": "yes", "model": m, "when": "${steps.a.output.go}", "input": {"branch": "yes"}},
            {"id": "no", "model": m, "when": "${!(steps.a.output.go)}", "input": {"branch": "no"}},
            {"id": "after_no", "model": m, "input": {"from": "${steps.no.output.branch}"}},
            {"id": "after_yes", "model": m, "input": {"from": "${steps.yes.output.branch}"}},
        ],
        "output": {"yes": "${steps.after_yes.output}", "no": "${steps.after_no.output}"},
    }
    view = await fleet.run(spec, {"go": True})
    run = view["run_id"]
    jid = await fleet.ids(run)
    states = {sid: step["state"] for sid, step in view["steps"].items()}
    assert states == {
        "a": "succeeded",
        "yes": "succeeded",
        "no": "skipped",
        "after_no": "skipped",
        "after_yes": "succeeded",
    }
    assert view["state"] == "succeeded" and view["output"]["yes"]["from"] == "yes" and view["output"]["no"] is None
    assert view["steps"]["no"]["job_ids"] == [] and view["steps"]["after_no"]["job_ids"] == []
    assert await fleet.store.get_many([jid("no", 0), jid("after_no", 0)]) == [None, None], "never published"
    await terminal_once(fleet, all_job_ids(view))


# -- retries --------------------------------------------------------------------------------------------------
async def test_a_step_retried_twice_succeeds_on_its_third_run(fleet: DagFleet, unique) -> None:
    m, k = fleet.model, key()
    spec = {
        "name": f"retry-{unique}",
        "steps": [
            {"id": "flaky", "model": m, "retries": 2, "input": {"key": "${input.key}", "fail_first": 2, "v": 1}},
            {"id": "next", "model": m, "input": {"v": "${steps.flaky.output.v}"}},
        ],
        "output": "${steps.next.output.v}",
    }
    view = await fleet.run(spec, {"key": k})
    run = view["run_id"]
    jid = await fleet.ids(run)
    assert view["state"] == "succeeded" and view["output"] == 1, view
    record = await fleet.store.get(jid("flaky", 0))
    assert record is not None and record.state is JobState.succeeded and record.deliveries == 3
    assert fleet.runs_of(k) == 3
    await terminal_once(fleet, all_job_ids(view))


async def test_a_step_out_of_retries_fails_the_run_with_its_error(fleet: DagFleet, unique) -> None:
    m, k = fleet.model, key()
    spec = {
        "name": f"noretry-{unique}",
        "steps": [
            {"id": "flaky", "model": m, "retries": 1, "input": {"key": "${input.key}", "fail_first": 2}},
            {"id": "next", "model": m, "input": {"v": "${steps.flaky.output.key}"}},
        ],
        "output": "${steps.next.output}",
    }
    view = await fleet.run(spec, {"key": k})
    run = view["run_id"]
    jid = await fleet.ids(run)
    assert view["state"] == "failed", view
    assert view["error"]["step"] == "flaky" and "fails its run 2" in view["error"]["message"]
    record = await fleet.store.get(jid("flaky", 0))
    assert record is not None and record.state is JobState.failed and record.deliveries == 2
    assert fleet.runs_of(k) == 2
    assert await fleet.store.get(jid("next", 0)) is None, "the dependant of a failed step is never published"


# -- on_error -------------------------------------------------------------------------------------------------
async def test_on_error_fail_fails_the_run_once_and_the_join_never_runs(fleet: DagFleet, unique) -> None:
    k = key()
    view = await fleet.run(fan_spec(f"fail-{unique}", fleet.model), {"texts": list("abcdef"), "key": k, "bad": [2, 4]})
    run = view["run_id"]
    jid = await fleet.ids(run)
    assert view["state"] == "failed", view
    assert view["error"]["step"] == "each" and f"step {k}-2 fails for good" in view["error"]["message"]
    assert view["steps"]["join"]["state"] != "succeeded" and view["steps"]["join"]["job_ids"] == []
    assert fleet.runs_of(f"{k}-join") == 0 and await fleet.store.get(jid("join", 0)) is None
    failed = [b for b, a in fleet.dags.of(run) if b["run"]["outcome"] is None and a["run"]["outcome"] is not None]
    assert len(failed) == 1, "the run fails once"
    errors = {repr(a["run"]["error"]) for _, a in fleet.dags.of(run) if a["run"]["outcome"]}
    assert len(errors) == 1, "the run's error is set once and never replaced"
    await terminal_once(fleet, all_job_ids(view))


async def test_on_error_continue_gives_the_join_null_for_the_failed_item(fleet: DagFleet, unique) -> None:
    k = key()
    spec = fan_spec(f"cont-{unique}", fleet.model, on_error="continue")
    view = await fleet.run(spec, {"texts": list("abcd"), "key": k, "bad": [2]})
    run = view["run_id"]
    jid = await fleet.ids(run)
    assert view["state"] == "succeeded", view
    assert view["steps"]["each"]["state"] == "failed"
    join = await fleet.store.get(jid("join", 0))
    assert join is not None and join.state is JobState.succeeded
    outputs = join.output["outputs"]
    assert outputs[2] is None and [o["text"] for i, o in enumerate(outputs) if i != 2] == ["a", "b", "d"]
    assert fleet.runs_of(f"{k}-join") == 1
    await terminal_once(fleet, all_job_ids(view))


# -- run timeout and cancel -----------------------------------------------------------------------------------
def slow_chain(name: str, model: str, sleep_ms: float) -> dict[str, Any]:
    """slow (sleeps) -> s2 -> s3, each keyed ``<key>[-s2|-s3]`` in ``Steps.runs``."""
    s2 = {"key": "${join('-', [input.key, 's2'])}", "after": "${steps.slow.output.key}"}
    s3 = {"key": "${join('-', [input.key, 's3'])}", "x": "${steps.s2.output.key}"}
    return {
        "name": name,
        "steps": [
            {"id": "slow", "model": model, "input": {"key": "${input.key}", "sleep_ms": sleep_ms}},
            {"id": "s2", "model": model, "input": s2},
            {"id": "s3", "model": model, "input": s3},
        ],
        "output": "${steps.s3.output}",
    }


async def test_a_run_past_its_timeout_ends_expired(fleet: DagFleet, unique) -> None:
    k = key()
    name, _, _ = await fleet.runner.register(slow_chain(f"timeout-{unique}", fleet.model, 2500))
    _, doc = await fleet.runner.start(name, {"key": k}, timeout_s=1.0)
    run = doc["run"]["run_id"]
    jid = await fleet.ids(run)
    doc = await fleet.runner.wait(run, 10)
    view = await fleet.runner.view(run)
    assert view["state"] == "expired", view
    assert doc["finished_at"] - doc["created_at"] < 2.5, "the run expires at its timeout, not when the step ends"
    await asyncio.sleep(2.5)  # the slow step finishes computing
    assert fleet.runs_of(f"{k}-s2") == 0 and await fleet.store.get(jid("s2", 0)) is None
    record = await fleet.store.get(jid("slow", 0))
    assert record is not None and record.terminal and record.state is not JobState.succeeded
    assert (await fleet.runner.view(run))["state"] == "expired", "a late result does not revive the run"
    await terminal_once(fleet, [jid("slow", 0)])


async def test_cancel_while_a_step_runs_ends_the_run_and_its_jobs(fleet: DagFleet, unique) -> None:
    k = key()
    name, _, _ = await fleet.runner.register(slow_chain(f"cancel-{unique}", fleet.model, 2000))
    _, doc = await fleet.runner.start(name, {"key": k})
    run = doc["run"]["run_id"]
    jid = await fleet.ids(run)

    async def running() -> bool:
        record = await fleet.store.get(jid("slow", 0))
        return record is not None and record.state is JobState.running

    await eventually(running, 15, "the slow step running")
    after = await fleet.runner.cancel(run)
    assert after["finished_at"] is not None
    view = await fleet.runner.view(run)
    assert view["state"] == "cancelled"
    assert (await fleet.store.get(jid("slow", 0))).state is JobState.cancelled  # type: ignore[union-attr]
    await asyncio.sleep(2.5)  # the slow step finishes computing; its result loses to the cancel
    assert (await fleet.store.get(jid("slow", 0))).state is JobState.cancelled  # type: ignore[union-attr]
    assert fleet.runs_of(f"{k}-s2") == 0 and fleet.runs_of(f"{k}-s3") == 0
    assert await fleet.store.get_many([jid("s2", 0), jid("s3", 0)]) == [None, None]
    view = await fleet.runner.view(run)
    assert view["state"] == "cancelled" and view["steps"]["s2"]["state"] in ("pending", "cancelled")
    await terminal_once(fleet, [jid("slow", 0)])


async def test_a_start_is_idempotent_on_its_run_id(fleet: DagFleet, unique) -> None:
    name, _, _ = await fleet.runner.register(chain_spec(f"idem-{unique}", fleet.model, 2))
    created, _ = await fleet.runner.start(name, {"v": 1}, run_id=f"r-{unique}")
    again, doc = await fleet.runner.start(name, {"v": 2}, run_id=f"r-{unique}")
    assert created and not again and doc["run"]["input"] == {"v": 1}
    await fleet.runner.wait(f"r-{unique}", 20)
    view = await fleet.runner.view(f"r-{unique}")
    assert view["state"] == "succeeded" and view["output"]["v"] == 1
    await terminal_once(fleet, all_job_ids(view))


# -- the shipped examples -------------------------------------------------------------------------------------
@pytest.mark.parametrize("example", ["chain", "fanout"])
async def test_the_examples_run_on_echo_workers(infra, settings, example) -> None:
    broker, store = infra
    dags = Stores.beside(store).dags
    runner = DagRunner(broker, store, dags, BUILTIN_SPECS)
    run_input = {"value": 42} if example == "chain" else {"items": list(range(10))}
    async with Worker(EchoHandler(), broker, store, settings=settings, on_settled=[runner.on_settled]):
        name, _, _ = await runner.register((EXAMPLES / f"{example}.yaml").read_text())
        _, doc = await runner.start(name, run_input)
        doc = await runner.wait(doc["run"]["run_id"], 30)
        view = await runner.view(doc["run"]["run_id"])
    assert view["state"] == "succeeded", view
    if example == "chain":
        assert view["output"] == {"value": 42, "hops": 5}
    else:
        assert view["output"] == {"count": 10, "items": list(range(10))}
