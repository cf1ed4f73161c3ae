"""Issue 26, item 3 and the spec part of item 5: nothing a spec, an expression or a run start carries runs unbounded.

The limits themselves (``fleet.dags.limits``) as tables, then each attack of the issue against a real gateway process on
NATS + Redis: a 4xx naming the limit (or, for a run whose evaluation goes over its budget, a run that failed saying
so) within a second, while ``/healthz`` answers within ``HEALTHZ_BOUND_S``. The attack on a later step is evaluated
by a real worker's settle hook, whose event loop is watched the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fleet.consumers.handlers import with_name
from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.worker import Worker
from fleet.dags import limits
from fleet.dags.expressions import ExpressionError, compile_expression
from fleet.dags.runner import DagRunner
from fleet.dags.spec import load_spec, parse_text
from fleet.errors import DagInvalid
from fleet.store.bundle import Stores
from tests.gateway_helpers import WORKER_SETTINGS, model_refs, urls_for
from tests.infra import connected_pair, settings_for
from tests.limits_fixtures import (
    HEALTHZ_BOUND_S,
    REQUEST_BOUND_S,
    Gateway,
    gateway_fixture,  # noqa: F401  (a fixture)
    one_step,
)

TEN = "[*].[@,@,@,@,@,@,@,@,@,@] | []"


def multiplying(root: str, levels: int = 6) -> str:
    """``length(<root>[*].[@ x10] | [] | ...)``: 10^(levels+1) values from a list of ten."""
    return "${length(" + root + " | ".join([TEN] * levels) + ")}"


# -- the limits as tables -------------------------------------------------------------------------------------
EXPRESSION_ATTACKS = {
    "5,000 (": ("(" * 5000 + "input" + ")" * 5000, "MAX_EXPRESSION_CHARS"),
    "5,000 !": ("!" * 5000 + "input", "MAX_EXPRESSION_CHARS"),
    "3,000 [": ("[" * 3000 + "input" + "]" * 3000, "MAX_EXPRESSION_CHARS"),
    "200 KB chain": ("input" + ".a" * 100_000, "MAX_EXPRESSION_CHARS"),
    "2,000 (": ("(" * 2000 + "input" + ")" * 2000, "MAX_EXPRESSION_NESTING"),
    "2,000 !": ("!" * 2000 + "input", "MAX_EXPRESSION_NESTING"),
    "1,000 projections": ("input.a" + "[*]" * 1000, "MAX_EXPRESSION_NESTING"),
    "500 filters": ("input" + "[?a" * 500 + "]" * 500, "MAX_EXPRESSION_NESTING"),
    "900 !(": ("!(" * 900 + "input" + ")" * 900, "MAX_EXPRESSION_NESTING"),
    "1,000 &": ("sort_by(input.l, " + "& " * 1000 + "a)", "MAX_EXPRESSION_NESTING"),
    "1,300 pipes": ("input" + "|a" * 1300, "MAX_EXPRESSION_TREE_DEPTH"),
    "1,300 ors": ("input" + "||a" * 1300, "MAX_EXPRESSION_TREE_DEPTH"),
    "NaN literal": ("`NaN`", "finite"),
    "1e400 literal": ("`[1, 1e400]`", "finite"),
    "surrogate literal": ('`"\\ud800x"`', "surrogate"),
}


@pytest.mark.parametrize("body, named", EXPRESSION_ATTACKS.values(), ids=EXPRESSION_ATTACKS.keys())
def test_an_expression_over_a_limit_is_refused_before_it_is_parsed_deeper(body: str, named: str) -> None:
    start = time.monotonic()
    with pytest.raises(ExpressionError) as refused:
        compile_expression("${" + body + "}")
    assert time.monotonic() - start < REQUEST_BOUND_S
    assert named in refused.value.message
    assert len(refused.value.message) < 500  # a refusal quotes the head of a long expression, not all of it


@pytest.mark.parametrize(
    "body",
    [
        "{a: input.x[*].y | [0], b: length(steps.s.outputs[?a > `1`])}",
        "input" + ".a" * 2000,  # a long chain is flat: within the length limit, fine
        "!(!(!(!(input.a))))",
        "sort_by(input.l, &a)[*].b | [?c == 'x'] | join(',', @)",
        "input.a" + "[*].b" * 12,
        "`12345678901234567890123456789` || `1.5`",
    ],
)
def test_expressions_within_the_limits_compile(body: str) -> None:
    compile_expression("${" + body + "}")


def test_evaluation_stops_at_its_budget_not_after_producing_every_value() -> None:
    expression = compile_expression(multiplying("input.l"))
    start = time.monotonic()
    with pytest.raises(ExpressionError) as refused:
        expression.search({"input": {"l": list(range(10))}})
    assert time.monotonic() - start < REQUEST_BOUND_S  # 10^7 values took about 20 s
    assert "MAX_EVALUATION_VALUES" in refused.value.message
    assert compile_expression(multiplying("input.l", 3)).search({"input": {"l": list(range(10))}}) == 10**4


def test_one_budget_is_shared_by_the_searches_of_a_pass() -> None:
    expression = compile_expression(multiplying("input.l", 3))  # about 12,000 values each
    context = {"input": {"l": list(range(10))}}
    for _ in range(40):  # 480,000 values: each search alone is fine
        expression.search(context)
    with limits.value_budget(), pytest.raises(ExpressionError, match="MAX_EVALUATION_VALUES"):
        for _ in range(40):
            expression.search(context)


def test_functions_are_charged_for_what_they_build() -> None:
    many = "[" + ",".join(["@"] * 600) + "]"
    expression = compile_expression("${input.s | " + many + " | length(join('', @))}")
    with pytest.raises(ExpressionError, match="MAX_EVALUATION_VALUES"):
        expression.search({"input": {"s": "x" * 100_000}})  # 60 MB of text, refused before it is built
    with pytest.raises(ExpressionError, match="finite"):
        compile_expression("${sum([`1e308`, `1e308`])}").search({})


SPEC_TEXTS = {
    "YAML [ x500": ("[" * 500 + "]" * 500, "nests over 64"),
    "YAML [ x10,000": ("[" * 10_000 + "]" * 10_000, "nest"),
    "YAML - x3,000": ("- " * 3000 + "a", "nests over 64"),
    "YAML indented x100": ("".join(" " * i + "a:\n" for i in range(100)), "nests over 64"),
    "YAML { x3,000": ("a: " + "{a: " * 3000 + "}" * 3000, "nest"),
    "JSON [ x500": ('{"a": ' + "[" * 500 + "]" * 500 + "}", "MAX_SPEC_DEPTH"),
    "JSON [ x100,000": ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "MAX_SPEC_DEPTH"),
    "JSON 5,000 digits": ('{"name": "x", "n": ' + "7" * 5000 + "}", "4,300 digits"),
    "YAML 5,000 digits": ("name: x\nn: " + "7" * 5000 + "\n", "4,300 digits"),
    "YAML lone surrogate": ('name: x\nn: "\\ud800x"\n', "invalid YAML"),
}


@pytest.mark.parametrize("text, named", SPEC_TEXTS.values(), ids=SPEC_TEXTS.keys())
def test_spec_text_over_a_limit_is_refused_before_the_parser_recurses(text: str, named: str) -> None:
    start = time.monotonic()
    with pytest.raises(DagInvalid) as refused:
        parse_text(text)
    assert time.monotonic() - start < REQUEST_BOUND_S
    assert named in refused.value.message


SPEC_VALUES = {
    "JSON NaN": ('{"name": "x", "steps": [], "output": NaN}', "output", "not a finite number"),
    "JSON -Infinity": ('{"name": "x", "steps": [], "output": {"a": [-Infinity]}}', "output.a[0]", "finite"),
    "JSON 1e400": ('{"name": "x", "steps": [], "output": 1e400}', "output", "finite"),
    "YAML .nan": ("name: x\nsteps: []\noutput: .nan\n", "output", "finite"),
    "YAML -.inf": ("name: x\nsteps: []\noutput: {a: -.inf}\n", "output.a", "finite"),
    "JSON lone surrogate": ('{"name": "x", "steps": [], "output": "\\ud800x"}', "output", "surrogate"),
    "JSON lone surrogate key": ('{"name": "x", "steps": [], "output": {"\\udfff": 1}}', "output", "surrogate"),
}


@pytest.mark.parametrize("text, path, named", SPEC_VALUES.values(), ids=SPEC_VALUES.keys())
def test_a_value_json_cannot_carry_is_refused_with_its_path(text: str, path: str, named: str) -> None:
    with pytest.raises(DagInvalid) as refused:
        load_spec(text)
    (problem,) = refused.value.problems
    assert problem["path"] == path and named in problem["message"]


def test_a_deep_spec_within_the_limit_loads() -> None:
    deep: Any = "${input.a}"
    for _ in range(limits.MAX_SPEC_DEPTH - 8):
        deep = [deep]
    spec = {"name": "deep", "steps": [{"id": "s", "model": "echo", "input": {"n": deep}}], "output": "${steps.s}"}
    assert load_spec(json.dumps(spec)).name == "deep"
    assert load_spec(spec).name == "deep"


# -- the attacks against a real gateway -----------------------------------------------------------------------
def _refusal(gateway: Gateway, response: Any) -> str:
    assert 400 <= response.status_code < 500, response.text[:500]
    return str(response.json()["error"]["message"])


GATEWAY_SPEC_ATTACKS = {
    "YAML [ x500": ("[" * 500 + "]" * 500, "nests over 64"),
    "YAML [ x10,000": ("[" * 10_000 + "]" * 10_000, "nest"),
    "JSON [ x1,000": ('{"a": ' + "[" * 1000 + "]" * 1000 + "}", "MAX_SPEC_DEPTH"),
    "JSON 5,000 digits": ('{"name": "x", "n": ' + "7" * 5000 + "}", "4,300 digits"),
    "YAML 5,000 digits": ("name: x\nn: " + "7" * 5000 + "\n", "4,300 digits"),
}


@pytest.mark.parametrize("text, named", GATEWAY_SPEC_ATTACKS.values(), ids=GATEWAY_SPEC_ATTACKS.keys())
def test_a_spec_too_deep_or_too_big_to_read_is_400_at_once(gateway: Gateway, text: str, named: str) -> None:
    kind = "application/json" if text.startswith("{") else "application/yaml"
    response, seconds, worst = gateway.send("POST", "/v1/dags", content=text, headers={"content-type": kind})
    assert response.status_code == 400 and named in _refusal(gateway, response)
    assert seconds < REQUEST_BOUND_S and worst < HEALTHZ_BOUND_S, (seconds, worst)


@pytest.mark.parametrize(
    "body, named",
    [EXPRESSION_ATTACKS[k] for k in ("5,000 (", "5,000 !", "3,000 [", "200 KB chain", "2,000 (", "1,300 pipes")],
    ids=["5,000 (", "5,000 !", "3,000 [", "200 KB chain", "2,000 (", "1,300 pipes"],
)
def test_an_expression_attack_is_422_naming_the_limit_at_once(gateway: Gateway, body: str, named: str) -> None:
    spec = one_step(gateway, f"attack-{len(body)}", "${" + body + "}")
    response, seconds, worst = gateway.send("POST", "/v1/dags", json=spec)
    assert response.status_code == 422 and named in _refusal(gateway, response)
    assert seconds < REQUEST_BOUND_S and worst < HEALTHZ_BOUND_S, (seconds, worst)


SPEC_VALUE_ATTACKS = {
    "NaN": ("NaN", "not a finite number"),
    "-Infinity": ("-Infinity", "not a finite number"),
    "1e400": ("1e400", "not a finite number"),
    "lone surrogate": ('"\\ud800x"', "surrogate"),
}


@pytest.mark.parametrize("value, named", SPEC_VALUE_ATTACKS.values(), ids=SPEC_VALUE_ATTACKS.keys())
def test_a_json_spec_holding_a_value_json_cannot_carry_is_422_with_its_path(
    gateway: Gateway, value: str, named: str
) -> None:
    text = json.dumps(one_step(gateway, "odd-value", "${input.a}")).replace('"${input.a}"', value)
    response, _, _ = gateway.send("POST", "/v1/dags", content=text, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    (problem,) = response.json()["error"]["details"]
    assert problem["path"] == "input.n" and problem["step"] == "s" and named in problem["message"]


RUN_BODY_ATTACKS = {  # read by the gateway's one JSON parser (fleet.strict_json), as every request body is
    "5,000 digits": ('{"input": {"a": ' + "7" * 5000 + "}}", 422, "over the limit of 4300 digits"),
    "nested 1,000": ('{"input": {"a": ' + "[" * 1000 + "]" * 1000 + "}}", 400, "over the limit of 100"),
    "NaN": ('{"input": {"a": NaN}}', 422, "the number NaN, which JSON cannot carry"),
    "1e400": ('{"input": {"a": [1e400]}}', 422, "the number 1e400, which JSON cannot carry"),
    "lone surrogate": ('{"input": {"a": "\\ud800x"}}', 422, "surrogate"),
}


@pytest.mark.parametrize("body, status, named", RUN_BODY_ATTACKS.values(), ids=RUN_BODY_ATTACKS.keys())
def test_a_run_start_body_json_cannot_carry_is_a_4xx_naming_it(
    gateway: Gateway, body: str, status: int, named: str
) -> None:
    registered = gateway.http.post("/v1/dags", json=one_step(gateway, "plain", "${input.a}"))
    assert registered.status_code == 201, registered.text
    headers = {"content-type": "application/json"}
    response, seconds, worst = gateway.send("POST", "/v1/dags/plain/runs", content=body, headers=headers)
    assert response.status_code == status and named in _refusal(gateway, response)
    assert seconds < REQUEST_BOUND_S and worst < HEALTHZ_BOUND_S, (seconds, worst)


def test_an_input_schema_that_refers_to_itself_is_422_at_run_start(gateway: Gateway) -> None:
    spec = {**one_step(gateway, "self-schema", "${input.a}"), "input_schema": {"allOf": [{"$ref": "#"}]}}
    registered = gateway.http.post("/v1/dags", json=spec)
    assert registered.status_code == 201, registered.text
    response, seconds, worst = gateway.send("POST", "/v1/dags/self-schema/runs", json={"input": {"a": 1}})
    assert response.status_code == 422 and "refers to itself" in _refusal(gateway, response)
    assert seconds < REQUEST_BOUND_S and worst < HEALTHZ_BOUND_S, (seconds, worst)


def test_a_multiplying_projection_at_run_start_fails_the_run_at_once(gateway: Gateway) -> None:
    registered = gateway.http.post("/v1/dags", json=one_step(gateway, "multiply", multiplying("input.l")))
    assert registered.status_code == 201, registered.text
    body = {"input": {"l": list(range(10))}}
    response, seconds, worst = gateway.send("POST", "/v1/dags/multiply/runs", json=body)
    assert response.status_code == 202 and response.json()["state"] == "failed", response.text
    assert seconds < REQUEST_BOUND_S and worst < HEALTHZ_BOUND_S, (seconds, worst)  # 10^7 values: 20 s
    run = gateway.http.get(f"/v1/runs/{response.json()['run_id']}").json()
    assert run["error"]["step"] == "s" and "MAX_EVALUATION_VALUES" in run["error"]["message"]


# -- the settle hook --------------------------------------------------------------------------------------------
class LoopWatch:
    """The worst lateness of a 5 ms tick on the running loop: how long the loop was kept from its other work."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            start = time.monotonic()
            await asyncio.sleep(0.005)
            self.worst = max(self.worst, time.monotonic() - start - 0.005)

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[LoopWatch]:
        self._task = asyncio.create_task(self._tick())
        try:
            yield self
        finally:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def two_steps(echo: str, expression: str) -> dict[str, Any]:
    steps = [
        {"id": "a", "model": echo, "input": {"l": "${input.l}"}},
        {"id": "b", "model": echo, "input": {"n": expression}},
    ]
    return {"name": "settle-attack", "steps": steps, "output": "${steps.b.output}"}


@pytest.mark.services
async def test_a_multiplying_projection_in_a_later_step_fails_it_without_stalling_the_worker(
    request: pytest.FixtureRequest, unique: str
) -> None:
    refs, (echo,) = model_refs(unique, "echo")
    settings = settings_for("nats+redis", urls_for(request, "nats+redis"), models=refs)
    async with connected_pair(settings) as (broker, store):
        handler = with_name(EchoHandler, echo)
        runner = DagRunner(broker, store, Stores.beside(store).dags, {echo: handler.spec})
        worker = Worker(
            handler(),
            broker,
            store,
            settings=WORKER_SETTINGS,
            worker_id=f"limits-{unique}",
            max_wait_ms=2,
            on_settled=[runner.on_settled],
        )
        async with worker:
            name, _, _ = await runner.register(two_steps(echo, multiplying("steps.a.output.l")))
            # Measured once more when the first watch saw the loop late (as ``Gateway.send`` does): a 2-core machine
            # shared with other work can hold the process off the CPU for a while, a blocked loop is blocked twice.
            for attempt in range(2):
                run_id = f"settle-{unique}-{attempt}"
                _, doc = await runner.start(name, {"l": list(range(10))}, run_id)
                await asyncio.sleep(0.1)  # the loop settles after the start; the watch is of the settle alone
                start = time.monotonic()
                async with LoopWatch().watching() as watch:
                    doc = await runner.wait(run_id, 10)
                seconds = time.monotonic() - start
                if watch.worst < HEALTHZ_BOUND_S:
                    break
    state = doc["run"]
    assert doc["finished_at"] is not None and state["outcome"] == "failed", state
    assert state["error"]["step"] == "b" and "MAX_EVALUATION_VALUES" in state["error"]["message"]
    assert seconds < 5 * REQUEST_BOUND_S  # the echo job of step a, then the refused evaluation of step b
    assert watch.worst < HEALTHZ_BOUND_S, watch.worst  # 10^7 values in the hook held the worker's loop 20 s


def test_a_backtracking_pattern_in_the_input_schema_is_cut_off_at_run_start(gateway: Gateway) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a|aa)+$"}}}
    spec = {**one_step(gateway, "redos", "${input.a}"), "input_schema": schema}
    registered = gateway.http.post("/v1/dags", json=spec)
    assert registered.status_code == 201, registered.text
    body = {"input": {"a": "a" * 40 + "b"}}  # Python's re backtracks for minutes on this, holding the GIL
    response, seconds, worst = gateway.send("POST", "/v1/dags/redos/runs", json=body)
    assert response.status_code == 422 and "MAX_PATTERN_SECONDS" in _refusal(gateway, response)
    assert seconds < REQUEST_BOUND_S and worst < HEALTHZ_BOUND_S, (seconds, worst)
    fine = gateway.http.post("/v1/dags/redos/runs", json={"input": {"a": "aaaa"}})
    assert fine.status_code == 202, fine.text
