"""`fleet dag validate | show | run` as a user meets them: real processes, the example files, a real `fleet up`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.processes import ROOT, fleet_process, run_fleet, wait_http_ready
from tests.services import free_port

EXAMPLES = ROOT / "dags" / "examples"
EXAMPLE_STEPS = {"chain": 5, "fanout": 2, "triage": 4}


def one_line_error(result: object, code: int) -> str:
    """The single stderr line of a failed command (no traceback)."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)  # type: ignore[attr-defined]
    stderr: str = result.stderr  # type: ignore[attr-defined]
    assert "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
    return stderr


@pytest.mark.parametrize("name", sorted(EXAMPLE_STEPS))
@pytest.mark.services
def test_validate_accepts_each_example(name: str) -> None:
    result = run_fleet("dag", "validate", str(EXAMPLES / f"{name}.yaml"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"ok: {name}, {EXAMPLE_STEPS[name]} steps"


@pytest.mark.services
def test_validate_prints_each_problem_on_its_own_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: bad\nsteps:\n"
        "  - {id: a, model: echo, input: {x: '${steps.b.output}'}}\n"
        "  - {id: b, model: nosuchmodel, input: {x: '${steps.nope.output}'}}\n"
        "output: '${steps.a.output}'\n"
    )
    result = run_fleet("dag", "validate", str(bad))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) >= 2, result.stderr
    assert any(line.startswith("step 'b': model: unknown model 'nosuchmodel'") for line in lines), lines
    assert any("step 'b'" in line and "nope" in line for line in lines), lines


@pytest.mark.services
def test_validate_knows_models_given_with_models(tmp_path: Path) -> None:
    spec = tmp_path / "custom.yaml"
    spec.write_text("name: custom\nsteps:\n  - {id: a, model: echo-cli, input: {x: 1}}\noutput: '${steps.a.output}'\n")
    assert run_fleet("dag", "validate", str(spec)).returncode == 1
    result = run_fleet("dag", "validate", str(spec), "--models", "tests.gateway_helpers:echo_cli")
    assert (result.returncode, result.stdout.strip()) == (0, "ok: custom, 1 steps"), result.stderr


@pytest.mark.services
def test_bad_files_are_one_line_errors(tmp_path: Path) -> None:
    assert "cannot read" in one_line_error(run_fleet("dag", "validate", str(tmp_path / "missing.yaml")), 2)
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\nsteps: [\n  - a: b\n")
    stderr = one_line_error(run_fleet("dag", "validate", str(broken)), 1)
    assert "line" in stderr and "column" in stderr and "invalid YAML" in stderr
    assert "cannot read" in one_line_error(run_fleet("dag", "show", str(tmp_path)), 2)  # a directory
    assert "cannot read" in one_line_error(run_fleet("dag", "run", "missing.yaml", "--url", "http://x"), 2)


@pytest.mark.services
def test_show_draws_the_steps_and_mermaid() -> None:
    table = run_fleet("dag", "show", str(EXAMPLES / "triage.yaml"))
    assert table.returncode == 0, table.stderr
    for text in ("split", "embed_each", "collect", "many", "embed", "${steps.split.output.texts}", "> `2`"):
        assert text in table.stdout, (text, table.stdout)
    mermaid = run_fleet("dag", "show", "--mermaid", str(EXAMPLES / "triage.yaml"))
    assert mermaid.returncode == 0
    assert mermaid.stdout.startswith("flowchart TD\n")
    assert "s0 --> s1" in mermaid.stdout and "(for each)" in mermaid.stdout and "(when)" in mermaid.stdout


@pytest.mark.services
def test_an_unreachable_gateway_is_a_one_line_error() -> None:
    url = "http://127.0.0.1:1"
    assert "cannot reach the gateway" in one_line_error(run_fleet("dag", "show", "chain", "--url", url), 1)
    run = run_fleet("dag", "run", str(EXAMPLES / "chain.yaml"), "--input", "{}", "--url", url)
    assert "127.0.0.1:1" in one_line_error(run, 1)
    assert "not valid JSON" in one_line_error(run_fleet("dag", "run", "chain", "--input", "{nope", "--url", url), 2)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `fleet up` (in-memory broker and store) serving echo and embed."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("dagcli") / "up.log"
    with fleet_process("up", "--port", str(port), "--models", "echo,embed", log=log) as proc:
        wait_http_ready(f"{base}/readyz", proc, log)
        yield base


@pytest.mark.services
def test_run_a_file_with_wait_prints_the_output(gateway: str) -> None:
    result = run_fleet(
        "dag", "run", str(EXAMPLES / "chain.yaml"), "--input", '{"value": 42}', "--wait", "--url", gateway
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"value": 42, "hops": 5}
    for sid in ("s1", "s2", "s3", "s4", "s5"):
        assert sid in result.stderr  # the live per-step display
    assert "succeeded" in result.stderr and "1/1" in result.stderr


@pytest.mark.services
def test_run_the_fan_out_examples_and_a_name(gateway: str) -> None:
    items = run_fleet(
        "dag", "run", str(EXAMPLES / "fanout.yaml"), "--input", '{"items": [1, 2, 3]}', "--wait", "--url", gateway
    )
    assert items.returncode == 0, items.stderr
    assert json.loads(items.stdout) == {"count": 3, "items": [1, 2, 3]}
    assert "3/3" in items.stderr
    texts = json.dumps({"texts": ["a cat", "a dog", "a bird"]})
    triage = run_fleet("dag", "run", str(EXAMPLES / "triage.yaml"), "--input", texts, "--wait", "--url", gateway)
    assert triage.returncode == 0, triage.stderr
    assert json.loads(triage.stdout)["n"] == 3
    started = run_fleet("dag", "run", "fanout", "--input", '{"items": ["x"]}', "--run-id", "cli-run", "--url", gateway)
    assert (started.returncode, started.stdout.strip()) == (0, "cli-run"), started.stderr
    view = httpx.get(f"{gateway}/v1/runs/cli-run", params={"wait": 20}).json()
    assert (view["state"], view["output"]) == ("succeeded", {"count": 1, "items": ["x"]})


@pytest.mark.services
def test_show_a_registered_name(gateway: str) -> None:
    assert run_fleet("dag", "run", str(EXAMPLES / "chain.yaml"), "--url", gateway).returncode == 0
    shown = run_fleet("dag", "show", "chain", "--url", gateway)
    assert shown.returncode == 0, shown.stderr
    assert "s5" in shown.stdout and "echo" in shown.stdout
    mermaid = run_fleet("dag", "show", "chain", "--mermaid", "--url", gateway)
    assert mermaid.stdout.startswith("flowchart TD") and "s3 --> s4" in mermaid.stdout
    assert "no DAG 'nope'" in one_line_error(run_fleet("dag", "show", "nope", "--url", gateway), 1)


@pytest.mark.services
def test_runs_that_fail_or_are_refused_exit_1(gateway: str) -> None:
    refused = run_fleet("dag", "run", str(EXAMPLES / "fanout.yaml"), "--input", '{"items": 3}', "--url", gateway)
    assert "input schema" in one_line_error(refused, 1)
    expired = run_fleet(
        "dag",
        "run",
        str(EXAMPLES / "chain.yaml"),
        "--input",
        '{"value": 1}',
        "--timeout-s",
        "0.001",
        "--wait",
        "--url",
        gateway,
    )
    assert expired.returncode == 1, (expired.stdout, expired.stderr)
    # The run's deadline is its first job's deadline: the job expires, which fails the run (or expires it).
    assert expired.returncode == 1 and "Traceback" not in expired.stderr
    assert "ended failed" in expired.stderr or "ended expired" in expired.stderr, expired.stderr
