"""A property of the DAG routes (issue 26, item 3): whatever spec, expression or run start a client sends, a real
gateway answers a 4xx or a success, never a 5xx, within ``REQUEST_BOUND_S``, and ``/healthz`` answers within
``HEALTHZ_BOUND_S`` while it does.

Hypothesis draws from a grammar of nasty shapes: every bracket kind and prefix operator nested up to 6,000 deep,
chains up to 200 KB, long pipes, projections that multiply, huge, NaN, infinite and lone-surrogate literals, wide
fan-outs, whole texts nested deep in YAML and JSON, integers of 5,000 digits and garbage bytes. A spec that registers
is started with a drawn input. Examples are bounded and derandomized (the database is off), so a run depends on the
seed alone and a failure prints the reproducing example. The gateway is a process of its own
(``tests.limits_fixtures``).
"""

from __future__ import annotations

import itertools
import json
import uuid
from typing import Any

import yaml
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from tests.limits_fixtures import (
    HEALTHZ_BOUND_S,
    REQUEST_BOUND_S,
    Gateway,
    gateway_fixture,  # noqa: F401  (a fixture)
)

MAX_EXAMPLES = 200
_names = (f"fuzz-{uuid.uuid4().hex[:8]}-{i}" for i in itertools.count())

OPENERS = {"(": ")", "[": "]", "{a: ": "}"}
TEN = "[*].[@,@,@,@,@,@,@,@,@,@] | []"


def _nested(opener: str, depth: int) -> str:
    return opener * depth + "input.a" + OPENERS[opener] * depth


def _multiplying(levels: int, width: int) -> str:
    level = "[*].[" + ",".join("@" * width) + "] | []"
    return "length(input.l" + " | ".join([level] * levels) + ")"


BODIES = st.one_of(
    st.builds(_nested, st.sampled_from(list(OPENERS)), st.integers(1, 6000)),
    st.builds(lambda op, n: op * n + "input.a", st.sampled_from(["!", "& ", "!("]), st.integers(1, 6000)),
    st.builds(lambda n: "input" + ".a" * n, st.integers(1, 100_000)),
    st.builds(
        lambda op, n: "input.a" + (op + "input.a") * n, st.sampled_from(["|", "||", "&&", "=="]), st.integers(1, 2000)
    ),
    st.builds(
        lambda k, n: "input.l" + k * n, st.sampled_from(["[*]", "[]", "[?a]", ".*", "[0]"]), st.integers(1, 1500)
    ),
    st.builds(_multiplying, st.integers(1, 8), st.integers(1, 12)),
    st.builds(lambda n: "`" + "9" * n + "`", st.integers(1, 6000)),
    st.sampled_from(
        ["`NaN`", "`-Infinity`", "`1e400`", '`"\\ud800x"`', "sum([`1e308`, `1e308`])", "avg(`[1e308, 1e308]`)"]
    ),
    st.sampled_from(["sort_by(input.l, &@)", "join(',', input.s[*])", "to_string(input)", "input.l[::-1]", "@", "*"]),
    st.text(max_size=200),
)
EVALUATED = st.one_of(  # bodies that compile, so that run starts evaluate them
    st.builds(_multiplying, st.integers(1, 8), st.integers(1, 12)),
    st.sampled_from(["input.a", "input.l", "length(input.l)", "to_string(input)", "sort_by(input.l, &@)"]),
    st.sampled_from(["input.l[*].[@, @]", "sum(input.l)", "input.l[?@ > `1`]", "join(',', input.s)", "`[1, 2]`"]),
)
EXPRESSIONS = st.one_of(BODIES, EVALUATED).map(lambda body: "${" + body + "}")
COMPILING = EVALUATED.map(lambda body: "${" + body + "}")


@st.composite
def specs(draw: st.DrawFn, expressions: st.SearchStrategy[str]) -> dict[str, Any]:
    """A spec of one to three echo steps whose fields are drawn ``expressions`` (the model is filled in later)."""
    steps: list[dict[str, Any]] = []
    for i in range(draw(st.integers(1, 3))):
        step: dict[str, Any] = {"id": f"s{i}", "model": "ECHO", "input": {"n": draw(expressions)}}
        if draw(st.booleans()):
            step["for_each"] = draw(st.one_of(expressions, st.just("${input.l}")))
        if draw(st.integers(0, 3)) == 0:
            step["when"] = draw(expressions)
        steps.append(step)
    return {"name": "NAME", "steps": steps, "output": draw(st.one_of(expressions, st.just("${steps.s0}")))}


def _deep_text(opener: str, depth: int) -> str:
    return (
        "name: NAME\nsteps: "
        + opener * depth
        + ("]" * depth if opener == "[" else "}" * depth if opener == "{a: " else "a")
    )


SPEC_TEXTS = st.one_of(
    st.builds(_deep_text, st.sampled_from(["[", "{a: ", "- "]), st.integers(1, 12_000)),
    st.builds(lambda n: '{"name": "NAME", "steps": ' + "[" * n + "]" * n + "}", st.integers(1, 100_000)),
    st.builds(
        lambda v: '{"name": "NAME", "steps": [], "output": ' + v + "}",
        st.sampled_from(["7" * 5000, "NaN", "-Infinity", "1e400", '"\\ud800x"', '{"\\udfff": 1}', "1" * 4300]),
    ),
    st.builds(
        lambda v: "name: NAME\nsteps: []\noutput: " + v + "\n",
        st.sampled_from(["7" * 5000, ".nan", "-.inf", '"\\ud800x"', "&a [*a]", "!!python/object:os.system x"]),
    ),
    st.binary(max_size=2000),
)

INPUT_VALUES = st.one_of(
    st.sampled_from(["7" * 5000, "NaN", "Infinity", "1e400", '"\\ud800x"', '{"\\ud800": 1}', "1" * 4300]),
    st.builds(lambda n: "[" * n + "]" * n, st.integers(1, 20_000)),
    st.builds(lambda n: "[" + ",".join(["0"] * n) + "]", st.sampled_from([0, 1, 12, 10_001])),
    st.builds(
        json.dumps,
        st.recursive(
            st.none() | st.integers() | st.text(max_size=20),
            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
            max_leaves=20,
        ),
    ),
)


def run_body(value: str, l_items: int) -> str:
    return '{"input": {"l": ' + json.dumps(list(range(l_items))) + ', "a": ' + value + ', "s": ["x", "y"]}}'


def _text(spec: dict[str, Any], name: str, echo: str, as_yaml: bool) -> tuple[bytes, str]:
    spec = {**spec, "name": name, "steps": [{**s, "model": echo} for s in spec["steps"]]}
    if as_yaml:
        return yaml.safe_dump(spec, allow_unicode=False).encode("utf-8", "surrogatepass"), "application/yaml"
    return json.dumps(spec).encode(), "application/json"


def _check(gateway: Gateway, what: str, response: Any, seconds: float, worst: float) -> None:
    assert response.status_code < 500, f"{what}: {response.status_code} {response.text[:300]}"
    assert seconds < REQUEST_BOUND_S * 2, f"{what}: {seconds:.2f}s"
    assert worst < HEALTHZ_BOUND_S, f"{what}: /healthz took {worst * 1000:.0f} ms"


FUZZ = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
    phases=(Phase.explicit, Phase.generate),  # no shrinking: a slow example shrinks for minutes; it prints whole
)


@FUZZ
@given(
    spec=st.one_of(specs(EXPRESSIONS), specs(COMPILING), SPEC_TEXTS),
    as_yaml=st.booleans(),
    value=INPUT_VALUES,
    l_items=st.sampled_from([0, 3, 10]),
)
def test_specs_expressions_and_run_starts_get_a_4xx_or_a_success_and_healthz_stays_fast(
    gateway: Gateway, spec: dict[str, Any] | str | bytes, as_yaml: bool, value: str, l_items: int
) -> None:
    name = next(_names)
    if isinstance(spec, dict):
        body, kind = _text(spec, name, gateway.echo, as_yaml)
    else:
        body = spec.replace("NAME", name).encode() if isinstance(spec, str) else spec
        kind = "application/json" if body.lstrip().startswith(b"{") else "application/yaml"
    response, seconds, worst = gateway.send("POST", "/v1/dags", content=body, headers={"content-type": kind})
    _check(gateway, f"POST /v1/dags {body[:200]!r}", response, seconds, worst)
    event(f"register {response.status_code}")
    if response.status_code != 201:
        return
    start = run_body(value, l_items).encode("utf-8", "surrogatepass")
    headers = {"content-type": "application/json"}
    response, seconds, worst = gateway.send("POST", f"/v1/dags/{name}/runs", content=start, headers=headers)
    _check(gateway, f"POST /v1/dags/{name}/runs {start[:200]!r} for {body[:300]!r}", response, seconds, worst)
    event(f"start {response.status_code} {response.json().get('state', '')}")
