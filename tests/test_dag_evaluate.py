"""The DAG evaluator as tables (chain, fan-out, fan-in, branch, skip, on_error, empty and bad fan-outs, output,
cancel, job ids) and a property: results in any order, with duplicates, give one final state and one launch per
step."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.dags.evaluate import (
    StepLaunch,
    advance,
    apply_result,
    cancel,
    context,
    new_run,
    ready_steps,
    run_state,
    run_view,
)
from fleet.dags.spec import load_spec
from fleet.dags.state import RunState
from fleet.dags.validate import CompiledDag, validate
from fleet.errors import InvalidInput
from fleet.schemas.models import BUILTIN_SPECS

EXAMPLES = Path(__file__).resolve().parent.parent / "dags" / "examples"


def compile_yaml(text: str) -> CompiledDag:
    return validate(load_spec(text), BUILTIN_SPECS)


def example(name: str) -> CompiledDag:
    return compile_yaml((EXAMPLES / f"{name}.yaml").read_text())


def echo(dag: CompiledDag, state: RunState, launch: StepLaunch) -> RunState:
    """Every job of a launch succeeds as echo would: its output is its input."""
    for job in launch.jobs:
        state = apply_result(dag, state, launch.step_id, job.index, "succeeded", job.input)
    return state


def by_step(launches: list[StepLaunch]) -> dict[str, StepLaunch]:
    return {launch.step_id: launch for launch in launches}


def steps_states(state: RunState) -> dict[str, str]:
    return {sid: run.state for sid, run in state.steps.items()}


def run_echo(dag: CompiledDag, state: RunState) -> RunState:
    """Run to the end, every job succeeding as echo."""
    state, launches = advance(dag, state)
    while launches:
        for launch in launches:
            state = echo(dag, state, launch)
        state, launches = advance(dag, state)
    return state


# -- chain ----------------------------------------------------------------------------------------------------
def test_a_chain_runs_step_after_step() -> None:
    dag = example("chain")
    state = new_run(dag, "run1", {"value": "v"})
    for expected in ("s1", "s2", "s3", "s4", "s5"):
        state, launches = advance(dag, state)
        assert [launch.step_id for launch in launches] == [expected]
        assert launches[0].jobs[0].job_id == f"run1.{expected}.0"
        assert run_state(dag, state).state == "running"
        state = echo(dag, state, launches[0])
    assert advance(dag, state) == (state, [])
    assert run_state(dag, state).state == "succeeded"
    assert run_state(dag, state).output == {"value": "v", "hops": 5}


def test_ready_steps_does_not_record_the_launch() -> None:
    dag = example("chain")
    state = new_run(dag, "r", {"value": 1})
    assert [launch.step_id for launch in ready_steps(dag, state)] == ["s1"]
    assert [launch.step_id for launch in ready_steps(dag, state)] == ["s1"]
    state, _ = advance(dag, state)
    assert ready_steps(dag, state) == []
    assert state.steps["s1"].state == "running"
    assert advance(dag, state)[0] is state


# -- fan-out, fan-in, branch ------------------------------------------------------------------------------------
def triage_until_collect(texts: list[str]) -> tuple[CompiledDag, RunState, dict[str, StepLaunch]]:
    dag = example("triage")
    state, launches = advance(dag, new_run(dag, "t1", {"texts": texts}))
    state = echo(dag, state, launches[0])
    state, launches = advance(dag, state)
    fan = by_step(launches)["embed_each"]
    assert [(j.index, j.item, j.input) for j in fan.jobs] == [(i, t, {"text": t}) for i, t in enumerate(texts)]
    assert [j.job_id for j in fan.jobs] == [f"t1.embed_each.{i}" for i in range(len(texts))]
    for job in reversed(fan.jobs):  # the join fires whatever the order
        assert advance(dag, state)[1] == []
        state = apply_result(dag, state, "embed_each", job.index, "succeeded", {"dim": 384, "n": job.index})
    state, launches = advance(dag, state)
    return dag, state, by_step(launches)


def test_fan_out_then_fan_in_with_a_true_branch() -> None:
    dag, state, launches = triage_until_collect(["a", "b", "c"])
    assert set(launches) == {"collect", "many"}
    assert launches["collect"].jobs[0].input == {"n": 3, "first": 384}
    assert launches["many"].jobs[0].input == {"many": True}
    state = echo(dag, echo(dag, state, launches["collect"]), launches["many"])
    status = run_state(dag, state)
    assert (status.state, status.output) == ("succeeded", {"n": 3, "first": 384})
    assert state.steps["embed_each"].outputs == tuple({"dim": 384, "n": i} for i in range(3))


def test_a_false_branch_is_skipped() -> None:
    dag, state, launches = triage_until_collect(["a", "b"])
    assert set(launches) == {"collect"}
    assert state.steps["many"].state == "skipped"
    state = echo(dag, state, launches["collect"])
    assert run_state(dag, state).state == "succeeded"


SKIPS = """
name: skips
steps:
  - {id: root, model: echo, input: {}}
  - {id: gated, model: echo, when: "${input.on}", input: {}}
  - {id: child, model: echo, input: {x: "${steps.gated.output}"}}
  - {id: grandchild, model: echo, after: [child], input: {}}
  - {id: mixed, model: echo, after: [root, gated], input: {}}
  - {id: unrelated_when, model: echo, after: [gated], when: "${input.yes}", input: {}}
  - id: merge
    model: echo
    when: "${steps.gated.state == 'succeeded' || steps.root.state == 'succeeded'}"
    input: {gated: "${steps.gated.state}", root: "${steps.root.output}"}
  - {id: after_merge, model: echo, after: [merge], input: {}}
output: {merge: "${steps.merge.output}", child: "${steps.child.output}"}
"""


def test_skips_propagate_unless_the_when_reads_the_skipped_state() -> None:
    dag = compile_yaml(SKIPS)
    state = run_echo(dag, new_run(dag, "s", {"on": False, "yes": True}))
    assert steps_states(state) == {
        "root": "succeeded",
        "gated": "skipped",
        "child": "skipped",
        "grandchild": "skipped",
        "mixed": "skipped",
        "unrelated_when": "skipped",
        "merge": "succeeded",
        "after_merge": "succeeded",
    }
    status = run_state(dag, state)
    assert status.state == "succeeded"
    assert status.output == {"merge": {"gated": "skipped", "root": {}}, "child": None}


def test_nothing_is_skipped_when_the_branch_is_on() -> None:
    dag = compile_yaml(SKIPS)
    state = run_echo(dag, new_run(dag, "s", {"on": True, "yes": True}))
    assert set(steps_states(state).values()) == {"succeeded"}


# -- failures ---------------------------------------------------------------------------------------------------
FAN = """
name: fan
steps:
  - {id: each, model: echo, for_each: "${input.xs}", on_error: ON_ERROR, input: {x: "${item}"}}
  - {id: join, model: echo, input: {outs: "${steps.each.outputs}", state: "${steps.each.state}"}}
  - {id: later, model: echo, after: [join], input: {}}
output: "${steps.join.output}"
"""


def fan(on_error: str) -> CompiledDag:
    return compile_yaml(FAN.replace("ON_ERROR", on_error))


def fail_item(dag: CompiledDag, state: RunState, index: int, message: str = "boom") -> RunState:
    error = {"type": "model_error", "message": message, "retriable": False}
    return apply_result(dag, state, "each", index, "failed", None, error)


def test_a_failed_member_fails_the_run_once_and_the_join_never_runs() -> None:
    dag = fan("fail")
    state, _ = advance(dag, new_run(dag, "f", {"xs": [1, 2, 3]}))
    state = fail_item(dag, state, 1)
    assert run_state(dag, state).state == "running"  # other members are still computing
    state = apply_result(dag, state, "each", 0, "succeeded", {"x": 1})
    state = apply_result(dag, state, "each", 2, "succeeded", {"x": 3})
    status = run_state(dag, state)
    assert status.state == "failed"
    assert status.error == {"step": "each", "type": "model_error", "message": "boom"}
    assert advance(dag, state) == (state, [])
    assert steps_states(state) == {"each": "failed", "join": "cancelled", "later": "cancelled"}
    assert state.steps["each"].error == {"type": "model_error", "message": "boom", "index": 1}
    assert fail_item(dag, state, 1, "again") is state  # a redelivered failure changes nothing


def test_the_step_error_is_the_lowest_failed_index_whatever_the_order() -> None:
    dag = fan("continue")
    start, _ = advance(dag, new_run(dag, "f", {"xs": [1, 2, 3]}))
    one = fail_item(dag, fail_item(dag, apply_result(dag, start, "each", 0, "succeeded", {}), 2, "two"), 1, "one")
    other = fail_item(dag, fail_item(dag, apply_result(dag, start, "each", 0, "succeeded", {}), 1, "one"), 2, "two")
    assert one == other
    assert one.steps["each"].error == {"type": "model_error", "message": "one", "index": 1}


def test_on_error_continue_gives_the_join_nulls() -> None:
    dag = fan("continue")
    state, _ = advance(dag, new_run(dag, "c", {"xs": [1, 2, 3]}))
    state = apply_result(dag, state, "each", 2, "succeeded", {"x": 3})
    state = fail_item(dag, state, 0)
    state = apply_result(dag, state, "each", 0, "succeeded", {"x": 1})  # too late: the first terminal wins
    state = apply_result(dag, state, "each", 1, "expired", None, {"type": "expired", "message": "deadline"})
    state, launches = advance(dag, state)
    assert [launch.step_id for launch in launches] == ["join"]
    assert launches[0].jobs[0].input == {"outs": [None, None, {"x": 3}], "state": "failed"}
    state = run_echo(dag, echo(dag, state, launches[0]))
    status = run_state(dag, state)
    assert status.state == "succeeded"
    assert status.output == {"outs": [None, None, {"x": 3}], "state": "failed"}
    assert state.steps["each"].errors == (
        {"type": "model_error", "message": "boom"},
        {"type": "expired", "message": "deadline"},
        None,
    )


def test_a_retried_member_that_succeeds_lets_the_join_fire_once() -> None:
    dag = fan("fail")
    state, _ = advance(dag, new_run(dag, "r", {"xs": [1, 2]}))
    # a retriable failure never reaches the DAG (the worker retries it); only the terminal record does, maybe twice
    for _ in range(2):
        state = apply_result(dag, state, "each", 0, "succeeded", {"x": 1})
    state = apply_result(dag, state, "each", 1, "succeeded", {"x": 2})
    state, launches = advance(dag, state)
    assert [launch.step_id for launch in launches] == ["join"]
    again = apply_result(dag, state, "each", 1, "succeeded", {"x": 2})
    assert again is state and advance(dag, again)[1] == []


def test_an_empty_fan_out_succeeds_at_once() -> None:
    dag = fan("fail")
    state, launches = advance(dag, new_run(dag, "e", {"xs": []}))
    assert [launch.step_id for launch in launches] == ["join"]
    assert launches[0].jobs[0].input == {"outs": [], "state": "succeeded"}
    assert state.steps["each"].state == "succeeded" and state.steps["each"].items == ()


@pytest.mark.parametrize(
    ("xs", "message"),
    [
        ({"a": 1}, "for_each: ${input.xs} gave dict, not a list"),
        (None, "for_each: ${input.xs} gave null, not a list"),
        ("abc", "for_each: ${input.xs} gave str, not a list"),
    ],
)
def test_for_each_not_a_list_fails_the_step(xs: Any, message: str) -> None:
    dag = fan("fail")
    state, launches = advance(dag, new_run(dag, "n", {"xs": xs}))
    assert launches == []
    status = run_state(dag, state)
    assert status.state == "failed"
    assert status.error == {"step": "each", "type": "dag_for_each", "message": message}
    assert steps_states(state) == {"each": "failed", "join": "cancelled", "later": "cancelled"}


def test_a_launch_failure_under_continue_lets_dependants_run() -> None:
    dag = fan("continue")
    _, launches = advance(dag, new_run(dag, "n", {"xs": 7}))
    assert [launch.step_id for launch in launches] == ["join"]
    assert launches[0].jobs[0].input == {"outs": [], "state": "failed"}


COPIES = """
name: copies
steps:
  - {id: each, model: echo, for_each: "${input.xs}", input: {all: "${input.big}", at: "${index}"}}
output: "${steps.each.outputs}"
"""


def test_a_fan_out_whose_inputs_copy_a_large_value_is_stopped_near_the_byte_limit() -> None:
    dag = compile_yaml(COPIES)
    big = "x" * (1024 * 1024)  # a megabyte, copied into each of 10,000 items: 10 GB to publish
    state, launches = advance(dag, new_run(dag, "c", {"xs": list(range(10_000)), "big": big}))
    assert launches == []
    error = run_state(dag, state).error
    assert error is not None and error["type"] == "dag_input" and "MAX_LAUNCH_BYTES" in error["message"]
    assert "at item 63 of 10000" in error["message"]  # the 64th megabyte: stopped there, not after every item
    fits, launches = advance(dag, new_run(dag, "f", {"xs": list(range(63)), "big": big}))
    assert fits.steps["each"].state == "running" and len(launches[0].jobs) == 63


INPUTS = """
name: inputs
steps:
  - {id: a, model: echo, input: {x: "${input.x}"}}
  - {id: b, model: echo, input: "${steps.a.output.next}"}
  - {id: c, model: echo, input: {n: "${length(steps.a.output.x)}"}}
output: "${steps.b.output}"
"""


def test_an_input_that_is_not_an_object_or_raises_fails_the_step() -> None:
    dag = compile_yaml(INPUTS)
    state, launches = advance(dag, new_run(dag, "i", {"x": 5}))
    state, launches = advance(dag, echo(dag, state, launches[0]))
    assert launches == []
    status = run_state(dag, state)
    assert status.state == "failed"
    assert status.error == {"step": "b", "type": "dag_input", "message": "input evaluated to null, not an object"}
    assert state.steps["c"].state == "cancelled"  # launched in the same pass, never published


def test_an_expression_error_in_an_input_names_the_path() -> None:
    dag = compile_yaml(INPUTS.replace('"${steps.a.output.next}"', "{}"))
    state, launches = advance(dag, new_run(dag, "i", {"x": 5}))
    state, _ = advance(dag, echo(dag, state, launches[0]))
    error = state.steps["c"].error
    assert error is not None and error["type"] == "dag_input"
    assert error["message"].startswith("input.n: ${length(steps.a.output.x)}: ")


def test_the_output_is_evaluated_and_its_error_fails_the_run() -> None:
    dag = compile_yaml(INPUTS.replace('"${steps.a.output.next}"', "{}").replace("${steps.b.output}", "${abs(input)}"))
    state = run_echo(dag, new_run(dag, "o", {"x": "abc"}))
    status = run_state(dag, state)
    assert status.state == "failed"
    assert status.error is not None and status.error["type"] == "dag_output"
    assert status.error["message"].startswith("output: ${abs(input)}: ")


# -- cancel, input, bookkeeping -----------------------------------------------------------------------------------
def test_cancel_stops_pending_steps_and_keeps_running_ones_recording() -> None:
    dag = example("chain")
    state, _ = advance(dag, new_run(dag, "c", {"value": 1}))
    state = cancel(state)
    assert run_state(dag, state).state == "cancelled"
    assert steps_states(state) == {
        "s1": "running",
        "s2": "cancelled",
        "s3": "cancelled",
        "s4": "cancelled",
        "s5": "cancelled",
    }
    state = apply_result(dag, state, "s1", 0, "cancelled")
    assert state.steps["s1"].state == "cancelled"
    assert advance(dag, state)[1] == []
    assert run_state(dag, state).error == {"step": None, "type": "cancelled", "message": "the run was cancelled"}
    assert cancel(state, "expired") is state


def test_a_finished_run_is_not_cancelled() -> None:
    dag = example("chain")
    state = run_echo(dag, new_run(dag, "c", {"value": 1}))
    assert cancel(state, "expired", "the run's deadline passed") is state


def test_the_run_input_is_checked_against_the_input_schema() -> None:
    dag = example("triage")
    with pytest.raises(InvalidInput, match="does not match the DAG's input schema: 'texts' is a required") as caught:
        new_run(dag, "r", {})
    assert caught.value.errors == [{"loc": ["input"], "msg": "'texts' is a required property"}]
    with pytest.raises(InvalidInput, match=r"run id 'a\.b' is not allowed"):
        new_run(dag, "a.b", {"texts": []})


def test_bad_results_are_programming_errors() -> None:
    dag = example("chain")
    state, _ = advance(dag, new_run(dag, "b", {"value": 1}))
    with pytest.raises(ValueError, match="no step 'nope'"):
        apply_result(dag, state, "nope", 0, "succeeded")
    with pytest.raises(ValueError, match="not a terminal job state"):
        apply_result(dag, state, "s1", 0, "running")
    with pytest.raises(ValueError, match="1 jobs, so no index 3"):
        apply_result(dag, state, "s1", 3, "succeeded")


def test_the_run_state_round_trips_through_json() -> None:
    dag, state, _ = triage_until_collect(["a", "b", "c"])
    data = json.loads(json.dumps(state.to_dict()))
    assert RunState.from_dict(data) == state
    assert data["steps"]["embed_each"]["items"] == ["succeeded"] * 3
    assert context(dag, state)["steps"]["embed_each"]["outputs"][2] == {"dim": 384, "n": 2}


# -- the property: any order, duplicates ----------------------------------------------------------------------------
@st.composite
def dag_shapes(draw: st.DrawFn) -> tuple[CompiledDag, dict[str, Any], set[str]]:
    """Up to 8 echo steps with random acyclic dependencies; some fan out, some are conditional, some continue."""
    n = draw(st.integers(1, 8))
    steps: list[dict[str, Any]] = []
    run_input: dict[str, Any] = {"lists": {}, "flags": {}}
    failing: set[str] = set()
    for i in range(n):
        sid = f"s{i}"
        deps = draw(st.lists(st.sampled_from([f"s{j}" for j in range(i)]), unique=True, max_size=3)) if i else []
        fans = {d for d in deps if any(s["id"] == d and "for_each" in s for s in steps)}
        spec: dict[str, Any] = {"id": sid, "model": "echo", "on_error": "continue"}
        spec["input"] = {
            d: f"${{length(steps.{d}.outputs)}}" if d in fans else f"${{steps.{d}.state}}" for d in deps[:2]
        }
        spec["after"] = deps[2:]
        if draw(st.booleans()):
            spec["for_each"] = f"${{input.lists.{sid}}}"
            spec["input"]["item"] = "${item}"
            run_input["lists"][sid] = list(range(draw(st.integers(0, 3))))
        if draw(st.integers(0, 3)) == 0:
            spec["when"] = f"${{input.flags.{sid}}}"
            run_input["flags"][sid] = draw(st.booleans())
        for j in range(len(run_input["lists"].get(sid, [None]))):
            if draw(st.integers(0, 5)) == 0:
                failing.add(f"{sid}.{j}")
        steps.append(spec)
    data = {"name": "random", "steps": steps, "output": {s["id"]: f"${{steps.{s['id']}.state}}" for s in steps}}
    return validate(load_spec(data), BUILTIN_SPECS), run_input, failing


def simulate(
    dag: CompiledDag, run_input: dict[str, Any], failing: set[str], seed: int | None
) -> tuple[RunState, Counter[str]]:
    """Feed every job's result back, in FIFO order (seed None) or shuffled with duplicates."""
    rng = random.Random(seed)
    state, launches = advance(dag, new_run(dag, "p", run_input))
    launched = Counter(launch.step_id for launch in launches)
    queue = [(launch.step_id, job) for launch in launches for job in launch.jobs]
    while queue:
        sid, job = queue.pop(rng.randrange(len(queue)) if seed is not None else 0)
        if seed is not None and rng.random() < 0.3:
            queue.append((sid, job))  # the same result comes again later (a redelivery)
        if f"{sid}.{job.index}" in failing:
            state = apply_result(dag, state, sid, job.index, "failed", None, {"type": "model_error", "message": sid})
        else:
            state = apply_result(dag, state, sid, job.index, "succeeded", job.input)
        state, launches = advance(dag, state)
        launched.update(launch.step_id for launch in launches)
        queue += [(launch.step_id, job) for launch in launches for job in launch.jobs]
    return state, launched


@settings(max_examples=150, deadline=None)
@given(shape=dag_shapes(), seeds=st.lists(st.integers(0, 2**32), min_size=3, max_size=3))
def test_any_order_and_duplicates_give_one_final_state(
    shape: tuple[CompiledDag, dict[str, Any], set[str]], seeds: list[int]
) -> None:
    dag, run_input, failing = shape
    reference, launched = simulate(dag, run_input, failing, None)
    assert all(run.settled for run in reference.steps.values())
    assert run_state(dag, reference).state == "succeeded"
    for sid, run in reference.steps.items():
        assert launched[sid] == (1 if run.items else 0), sid
    for seed in seeds:
        final, again = simulate(dag, run_input, failing, seed)
        assert final == reference
        assert again == launched
        assert run_state(dag, final) == run_state(dag, reference)


@settings(max_examples=100, deadline=None)
@given(shape=dag_shapes(), seed=st.integers(0, 2**32))
def test_under_on_error_fail_each_step_launches_at_most_once_and_the_run_fails_once(
    shape: tuple[CompiledDag, dict[str, Any], set[str]], seed: int
) -> None:
    dag, run_input, failing = shape
    strict = validate(
        load_spec({**dag.spec.model_dump(), "steps": [{**s.model_dump(), "on_error": "fail"} for s in dag.spec.steps]}),
        BUILTIN_SPECS,
    )
    final, launched = simulate(strict, run_input, failing, seed)
    assert all(count == 1 for count in launched.values())
    assert all(run.settled for run in final.steps.values())
    failed = [sid for sid, run in final.steps.items() if run.state == "failed"]
    status = run_state(strict, final)
    if failed:
        assert status.state == "failed"
        assert status.error is not None and status.error["step"] in failed
    else:
        assert status.state == "succeeded"
        assert "cancelled" not in steps_states(final).values()


def test_the_run_view_lists_each_step_with_its_job_ids() -> None:
    dag, state, launches = triage_until_collect(["a", "b"])
    view = run_view(dag, state)
    assert view["state"] == "running" and view["output"] is None and view["error"] is None
    assert view["steps"]["embed_each"] == {
        "state": "succeeded",
        "job_ids": ["t1.embed_each.0", "t1.embed_each.1"],
        "error": None,
    }
    assert view["steps"]["many"] == {"state": "skipped", "job_ids": [], "error": None}
    assert view["steps"]["collect"]["state"] == "running"
    done = run_view(dag, echo(dag, state, launches["collect"]))
    assert (done["state"], done["output"]) == ("succeeded", {"n": 2, "first": 384})
