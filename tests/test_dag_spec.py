"""Table tests of the DAG DSL: loading (YAML, JSON, dict, limits), expressions' references, and validation's
refusals, each naming its step and path."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from fleet.dags.expressions import compile_expression, references, truthy
from fleet.dags.graph import edges, graph, mermaid, nodes
from fleet.dags.spec import MAX_SPEC_BYTES, MAX_STEPS, DagSpec, load_spec
from fleet.dags.state import RUN_ID_PATTERN, has_key, is_reserved, job_id, new_key, parse_job_id
from fleet.dags.validate import CompiledDag, validate
from fleet.errors import DagInvalid
from fleet.schemas.api import SubmitRequest
from fleet.schemas.models import BUILTIN_SPECS
from fleet.schemas.wire import JOB_ID_PATTERN

EXAMPLES = Path(__file__).resolve().parent.parent / "dags" / "examples"

TRIAGE_YAML = """\
name: triage
steps:
  - id: split
    model: echo
    input: {texts: "${input.texts}"}
  - id: embed_each            # fan-out: one job per item
    model: embed
    for_each: "${steps.split.output.texts}"
    input: {text: "${item}"}
  - id: collect               # fan-in: runs once, after every item
    model: echo
    input: {n: "${length(steps.embed_each.outputs)}", first: "${steps.embed_each.outputs[0].dim}"}
  - id: many                  # branch
    model: echo
    when: "${length(steps.embed_each.outputs) > `2`}"
    input: {many: true}
output: "${steps.collect.output}"
"""


def spec_dict(*steps: dict[str, Any], output: Any = None, **extra: Any) -> dict[str, Any]:
    return {"name": "t", "steps": list(steps), "output": output, **extra}


def step(sid: str, model: str = "echo", **fields: Any) -> dict[str, Any]:
    return {"id": sid, "model": model, "input": fields.pop("input", {}), **fields}


def compile_dict(data: dict[str, Any]) -> CompiledDag:
    return validate(load_spec(data), BUILTIN_SPECS)


def problems_of(data: dict[str, Any] | str) -> list[str]:
    with pytest.raises(DagInvalid) as caught:
        validate(load_spec(data), BUILTIN_SPECS)
    return [DagInvalid.line(p) for p in caught.value.problems]


# -- loading --------------------------------------------------------------------------------------------------
def test_yaml_json_and_dict_load_the_same_spec() -> None:
    from_yaml = load_spec(TRIAGE_YAML)
    as_dict = yaml.safe_load(TRIAGE_YAML)
    assert load_spec(json.dumps(as_dict)) == from_yaml
    assert load_spec(json.dumps(as_dict).encode()) == from_yaml
    assert load_spec(as_dict) == from_yaml
    assert [s.id for s in from_yaml.steps] == ["split", "embed_each", "collect", "many"]
    assert from_yaml.steps[1].for_each == "${steps.split.output.texts}"
    assert from_yaml.steps[0].on_error == "fail"


def test_a_yaml_flow_mapping_is_not_mistaken_for_json() -> None:
    spec = load_spec("{name: flow, steps: [{id: a, model: echo}], output: null}")
    assert spec.name == "flow"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name: t\nsteps:\n  - id: a\n    model: [echo\noutput: 1\n", r"line \d+, column \d+: invalid YAML"),
        ("name: t\nsteps:\n  - id: a\n\tmodel: echo\n", r"line 4, column 1: invalid YAML"),
        ('{"name": "t",\n "steps": [}', r"line 2, column 12: invalid JSON"),
        ("- a\n- b\n", r"must be a mapping with name, steps and output, not list"),
        ("just text", r"must be a mapping .* not str"),
        (b"name: \xff\xfe", r"not UTF-8"),
    ],
)
def test_malformed_text_is_refused_with_where(text: str | bytes, expected: str) -> None:
    with pytest.raises(DagInvalid) as caught:
        load_spec(text)
    assert re.search(expected, caught.value.message), caught.value.message


def test_unclosed_flow_list_names_its_line() -> None:
    with pytest.raises(DagInvalid) as caught:
        load_spec("name: t\nsteps:\n  - id: a\n    model: [echo\noutput: 1\n")
    assert re.search(r"line [45], column", caught.value.message)


def test_oversized_specs_are_refused() -> None:
    big = "name: t\n" + "#" * MAX_SPEC_BYTES
    with pytest.raises(DagInvalid, match=f"over the limit of {MAX_SPEC_BYTES} bytes"):
        load_spec(big)
    many = spec_dict(*[step(f"s{i}") for i in range(MAX_STEPS + 1)])
    with pytest.raises(DagInvalid, match=f"{MAX_STEPS + 1} steps, over the limit of {MAX_STEPS}"):
        load_spec(many)


def test_yaml_alias_bombs_are_refused() -> None:
    lines = ["name: t", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 7)]
    with pytest.raises(DagInvalid, match="YAML aliases"):
        load_spec("\n".join(lines))


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (spec_dict(step("Bad")), r"steps\[0\]\.id: 'Bad' is not a valid name"),
        ({**spec_dict(step("a")), "name": "no spaces"}, r"name: 'no spaces' is not a valid name"),
        (spec_dict(step("a", retries=-1)), r"step 'a': retries: Input should be greater than or equal to 0"),
        (spec_dict(step("a", on_error="ignore")), r"step 'a': on_error: Input should be 'fail' or 'continue'"),
        (spec_dict(step("a", colour="red")), r"step 'a': colour: unknown field"),
        (spec_dict(step("a", timeout_s=0)), r"step 'a': timeout_s: Input should be greater than 0"),
        ({"name": "t", "steps": []}, r"steps: List should have at least 1 item"),
        ({"name": "t", "steps": [step(True)], "output": 1}, r"steps\[0\]\.id: .*unquoted yes/no/on/off"),
        ({"name": "t", "steps": [step("a")]}, r"output: Field required"),
    ],
)
def test_shape_errors_name_the_step_and_path(data: dict[str, Any], expected: str) -> None:
    with pytest.raises(DagInvalid) as caught:
        load_spec(data)
    assert re.search(expected, caught.value.message), caught.value.message


def test_all_shape_errors_are_listed() -> None:
    with pytest.raises(DagInvalid) as caught:
        load_spec(spec_dict(step("a", retries=-1), step("b", on_error="x")))
    assert [p["step"] for p in caught.value.problems] == ["a", "b"]
    assert caught.value.message.startswith("the DAG spec has 2 problems: ")


# -- expressions ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("${steps.a.output}", {("a", "output")}),
        ("${steps.a.outputs[0].dim}", {("a", "outputs")}),
        ("${length(steps.e.outputs) > `2`}", {("e", "outputs")}),
        ("${{x: steps.a.output.x, y: steps.b.state}}", {("a", "output"), ("b", "state")}),
        ("${sort_by(steps.a.outputs, &dim)[0]}", {("a", "outputs")}),
        ("${steps.a.{x: output}}", {("a", None)}),
        ("${input.items[?kind == 'steps'].x}", set()),
        ("${steps.a.outputs[*].steps.b}", {("a", "outputs")}),  # inside a projection: the element's fields
        ("${input.a || steps.b.output}", {("b", "output")}),
        ("${item}", set()),
    ],
)
def test_references_walk_the_syntax_tree(source: str, expected: set[tuple[str, str | None]]) -> None:
    assert references(source) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, False), (False, False), ("", False), ([], False), ({}, False), (0, True), ("x", True), ([0], True)],
)
def test_jmespath_truthiness(value: Any, expected: bool) -> None:
    assert truthy(value) is expected


def test_an_expression_compiles_once_and_evaluates() -> None:
    expression = compile_expression("${length(steps.a.outputs)}")
    assert expression.search({"steps": {"a": {"outputs": [1, 2, 3]}}}) == 3
    assert expression.calls == (("length", 1),)


# -- validation -----------------------------------------------------------------------------------------------
def test_the_issue_example_validates_with_the_builtin_models() -> None:
    dag = validate(load_spec(TRIAGE_YAML), BUILTIN_SPECS)
    assert dag.order == ("split", "embed_each", "collect", "many")
    assert dag.steps["collect"].deps == ("embed_each",)
    assert dag.steps["embed_each"].fan_out and not dag.steps["collect"].fan_out
    assert dag.dependents("embed_each") == ("collect", "many")


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_each_example_validates(path: Path) -> None:
    dag = validate(load_spec(path.read_text()), BUILTIN_SPECS)
    assert dag.name == path.stem
    assert mermaid(dag).startswith("flowchart TD\n")


def test_examples_are_the_three_documented_ones() -> None:
    assert {p.name for p in EXAMPLES.glob("*.yaml")} == {"triage.yaml", "chain.yaml", "fanout.yaml"}
    chain = validate(load_spec((EXAMPLES / "chain.yaml").read_text()), BUILTIN_SPECS)
    assert chain.order == ("s1", "s2", "s3", "s4", "s5")
    assert [s.deps for s in chain.steps.values()] == [(), ("s1",), ("s2",), ("s3",), ("s4",)]


REFUSALS: list[tuple[str, dict[str, Any], str]] = [
    (
        "unknown step",
        spec_dict(step("embed_each", for_each="${input.x}"), step("collect", input={"n": "${steps.embed_eachh}"})),
        "step 'collect': input.n: unknown step 'embed_eachh' (did you mean 'embed_each'?)",
    ),
    (
        "unknown field",
        spec_dict(step("a"), step("b", input={"x": "${steps.a.outptu}"})),
        "step 'b': input.x: unknown field 'outptu' of step 'a': a step has output, outputs, state",
    ),
    (
        "outputs of a plain step",
        spec_dict(step("a"), step("b", input={"x": "${steps.a.outputs}"})),
        "step 'b': input.x: step 'a' has no for_each, so no outputs: use steps.a.output",
    ),
    (
        "output of a fan-out",
        spec_dict(step("a", for_each="${input.xs}"), step("b", input={"x": ["${steps.a.output}"]})),
        "step 'b': input.x[0]: step 'a' is a fan-out (for_each): use steps.a.outputs, one output per item",
    ),
    (
        "unknown model",
        spec_dict(step("a", model="gpt")),
        "step 'a': model: unknown model 'gpt'; known models: echo, embed, sleep",
    ),
    (
        "bad expression",
        spec_dict(step("a", input={"x": "${length(}"})),
        "step 'a': input.x: '${length(}' does not parse: ",
    ),
    (
        "unknown function",
        spec_dict(step("a", input={"x": "${size(input)}"})),
        "step 'a': input.x: unknown function size()",
    ),
    (
        "wrong arity",
        spec_dict(step("a", input={"x": "${length(input, input)}"})),
        "step 'a': input.x: length() takes 1 argument(s), given 2",
    ),
    (
        "item outside for_each",
        spec_dict(step("a", input={"x": "${item}"})),
        "step 'a': input.x: 'item' is only defined in the input of a for_each step",
    ),
    (
        "index in when",
        spec_dict(step("a", for_each="${input.xs}", when="${index}")),
        "step 'a': when: 'index' is only defined in the input of a for_each step",
    ),
    (
        "item in output",
        spec_dict(step("a"), output={"x": "${item}"}),
        "output.x: 'item' is only defined in the input of a for_each step",
    ),
    (
        "unknown name",
        spec_dict(step("a", input={"x": "${inputs.x}"})),
        "step 'a': input.x: unknown name 'inputs': the context has input, steps, item, index",
    ),
    (
        "whole context",
        spec_dict(step("a", input={"x": "${@}"})),
        "step 'a': input.x: reads the whole context",
    ),
    (
        "steps as a whole",
        spec_dict(step("a"), step("b", input={"x": "${steps.*.output}"})),
        "step 'b': input.x: reads steps as a whole",
    ),
    (
        "itself",
        spec_dict(step("a", input={"x": "${steps.a.output}"})),
        "step 'a': input.x: a step cannot read itself",
    ),
    (
        "after unknown",
        spec_dict(step("a", after=["b"])),
        "step 'a': after[0]: unknown step 'b'",
    ),
    (
        "after itself",
        spec_dict(step("a", after=["a"])),
        "step 'a': after[0]: a step cannot wait for itself",
    ),
    (
        "duplicate id",
        spec_dict(step("a"), step("a")),
        "step 'a': id: duplicate step id (steps[0] and steps[1])",
    ),
    (
        "when without ${}",
        spec_dict(step("a", when="input.flag")),
        "step 'a': when: must be an expression '${...}', not 'input.flag'",
    ),
    (
        "for_each without ${}",
        spec_dict(step("a", for_each="[1, 2]")),
        "step 'a': for_each: must be an expression '${...}'",
    ),
    (
        "static input not an object",
        spec_dict(step("a", input=[1, 2])),
        "step 'a': input: must be an object (the model's input), not list",
    ),
    (
        "static field of the wrong type",
        spec_dict(step("a", model="embed", input={"text": 5})),
        "step 'a': input.text: Input should be a valid string",
    ),
    (
        "static unknown field",
        spec_dict(step("a", model="embed", input={"text": "${input.t}", "txt": "x"})),
        "step 'a': input.txt: Extra inputs are not permitted",
    ),
    (
        "static model-level check",
        spec_dict(step("a", model="embed", input={})),
        "step 'a': input: Value error, give exactly one of 'text'",
    ),
    (
        "static out of range",
        spec_dict(step("a", model="sleep", input={"mean_ms": -1, "seed": "${input.seed}"})),
        "step 'a': input.mean_ms: Input should be greater than or equal to 0",
    ),
    (
        "input schema",
        spec_dict(step("a"), input_schema={"type": "objekt"}),
        "input_schema.type: not a valid JSON Schema",
    ),
]


@pytest.mark.parametrize(("case", "data", "expected"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_validation_refuses_naming_step_and_path(case: str, data: dict[str, Any], expected: str) -> None:
    found = problems_of(data)
    assert any(line.startswith(expected) for line in found), found


@pytest.mark.parametrize(
    ("steps", "cycle"),
    [
        ([step("a", input={"x": "${steps.b.output}"}), step("b", input={"x": "${steps.a.output}"})], "a -> b -> a"),
        ([step("a", after=["c"]), step("b", after=["a"]), step("c", when="${steps.b.state}")], "a -> c -> b -> a"),
        (
            [
                step("x"),
                step("a", after=["b", "x"]),
                step("b", after=["a"]),
                step("c", after=["d"]),
                step("d", after=["c"]),
            ],
            "a -> b -> a",
        ),
    ],
)
def test_cycles_are_named(steps: list[dict[str, Any]], cycle: str) -> None:
    found = problems_of(spec_dict(*steps))
    assert any(line.endswith(f"cycle: {cycle}") for line in found), found
    assert found[0].startswith(f"step '{cycle[0]}': ")


def test_two_cycles_are_both_named() -> None:
    found = problems_of(
        spec_dict(step("a", after=["b"]), step("b", after=["a"]), step("c", after=["d"]), step("d", after=["c"]))
    )
    assert found == ["step 'a': after[0]: cycle: a -> b -> a", "step 'c': after[0]: cycle: c -> d -> c"]


def test_every_problem_is_reported_at_once() -> None:
    data = spec_dict(
        step("a", model="gpt"),
        step("b", input={"x": "${steps.nope.output}", "y": "${item}"}),
        output="${steps.b.outputs}",
    )
    found = problems_of(data)
    assert len(found) == 4, found
    assert found[0].startswith("step 'a': model: unknown model")
    assert found[1] == "step 'b': input.x: unknown step 'nope'"
    assert found[2].startswith("step 'b': input.y: 'item'")
    assert found[3].startswith("output: step 'b' has no for_each")


def test_static_checks_leave_expression_fields_to_the_run() -> None:
    dag = compile_dict(spec_dict(step("a", model="embed", input={"text": "${input.t}"})))
    assert dag.steps["a"].spec.input == {"text": "${input.t}"}
    compile_dict(spec_dict(step("a", model="embed", input="${input.payload}")))
    compile_dict(spec_dict(step("a", model="sleep", input={"mean_ms": 5, "seed": "${input.seed}"})))


def test_dependencies_come_from_references_and_after() -> None:
    dag = compile_dict(
        spec_dict(
            step("d", after=["b"], when="${steps.c.state == 'succeeded'}", input={"x": "${steps.a.output}"}),
            step("c"),
            step("b"),
            step("a"),
        )
    )
    assert dag.order == ("c", "b", "a", "d")
    assert dag.steps["d"].deps == ("c", "b", "a")
    assert dag.steps["d"].when_reads_state == {"c"}


def test_graph_nodes_edges_and_mermaid() -> None:
    dag = compile_dict(
        spec_dict(
            step("end", input={"x": "${steps.fan.outputs}"}, after=["start"]),
            step("start"),
            step("fan", for_each="${input.xs}", after=["start"]),
            step("maybe", when="${steps.start.output.ok}"),
        )
    )
    assert [n["id"] for n in nodes(dag)] == ["start", "fan", "end", "maybe"]
    assert edges(dag) == [
        {"from": "start", "to": "fan", "kind": "after"},
        {"from": "start", "to": "end", "kind": "after"},
        {"from": "fan", "to": "end", "kind": "data"},
        {"from": "start", "to": "maybe", "kind": "data"},
    ]
    assert mermaid(dag) == (
        "flowchart TD\n"
        '    s0["start<br/>echo"]\n'
        '    s1[["fan<br/>echo (for each)"]]\n'
        '    s2["end<br/>echo"]\n'
        '    s3{{"maybe<br/>echo (when)"}}\n'
        "    s0 -.-> s1\n"
        "    s0 -.-> s2\n"
        "    s1 --> s2\n"
        "    s0 --> s3\n"
    )
    assert set(graph(dag)) == {"nodes", "edges", "mermaid"}


def test_job_ids_match_the_wire_pattern() -> None:
    longest_run = "r" * 58
    longest_step = "s" * 63
    jid = job_id(longest_run, longest_step, 9999)
    assert re.match(JOB_ID_PATTERN, jid)
    assert re.match(RUN_ID_PATTERN, longest_run) and not re.match(RUN_ID_PATTERN, "r" * 59)
    assert not re.match(RUN_ID_PATTERN, "a.b")
    assert parse_job_id(jid) == (longest_run, longest_step, 9999)
    assert parse_job_id("plain-job") is None
    assert parse_job_id("a.b.c") is None
    key = new_key()
    keyed = job_id(longest_run, longest_step, 9999, key)  # the run's key: 16 hex digits, fresh for each run
    assert re.match(JOB_ID_PATTERN, keyed) and keyed == f"{jid}.{key}" and new_key() != key
    assert parse_job_id(keyed) == (longest_run, longest_step, 9999) and has_key(keyed) and not has_key(jid)
    assert parse_job_id(f"{jid}.not-a-key") is None


def test_client_job_ids_of_a_step_s_shape_are_refused_at_submit() -> None:
    """No client may claim a step's id, of a run with a key or of one from before keys; other ids stay free."""
    for reserved in ("nightly-9.s.0", "nightly-9.s.0.0123456789abcdef", "r.s.12.x", "r.step_1.0.x.y"):
        assert is_reserved(reserved)
        with pytest.raises(ValidationError, match="reserved for the steps of DAG runs"):
            SubmitRequest(model="echo", input={}, job_id=reserved)
    for free in ("nightly-9", "a.b", "a.b.c", "v1.2", "a.b.0x", "a:b:0", "x" * 128):
        assert not is_reserved(free)
        assert SubmitRequest(model="echo", input={}, job_id=free).job_id == free
    with pytest.raises(ValidationError):  # a client's ids stay within 128 characters (a step's may be longer)
        SubmitRequest(model="echo", input={}, job_id="x" * 129)


def test_a_spec_is_a_frozen_model() -> None:
    spec = load_spec(TRIAGE_YAML)
    assert isinstance(spec, DagSpec)
    with pytest.raises(Exception, match="frozen"):
        spec.steps[0].model = "embed"  # type: ignore[misc]


def test_the_docs_dsl_example_validates() -> None:
    page = (EXAMPLES.parent.parent / "docs" / "guides" / "dags.md").read_text()
    section = page.split("## The DSL")[1]
    text = section.split("```yaml\n")[1].split("```")[0]
    assert validate(load_spec(text), BUILTIN_SPECS).order == ("split", "embed_each", "collect", "many")


def test_problems_are_json_for_a_422() -> None:
    with pytest.raises(DagInvalid) as caught:
        validate(load_spec(spec_dict(step("a", model="gpt"))), BUILTIN_SPECS)
    assert json.loads(json.dumps(caught.value.problems)) == [
        {"step": "a", "path": "model", "message": "unknown model 'gpt'; known models: echo, embed, sleep"}
    ]
