"""The documentation site builds strictly, and every code example marked as runnable runs.

A runnable example is a fenced block with an HTML comment on the line before it (see docs/development.md):

    <!-- check: python -->                 run it (top-level await allowed)
    <!-- check: python-gateway -->         run it against a real `fleet up` (http://127.0.0.1:8000 is replaced)
    <!-- check: shell -->                  run each command with bash; in a console block, `$ ` lines are commands
                                           and the lines after one are output it must print
    <!-- check: shell-gateway -->          the same against a real `fleet up` (FLEET_URL set, the URL replaced)
    <!-- check: dag -->                    load the YAML/JSON as a DAG spec and validate it on the built-in models
    <!-- check: json [module.Model] -->    parse strictly, then validate with that pydantic model when named
    <!-- check: manifest -->               read it as a model repository's model.yaml (fleet.repository.layout)
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import importlib.util
import inspect
import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from fleet import strict_json
from fleet.dags.spec import load_spec
from fleet.dags.validate import validate
from fleet.repository.layout import parse_manifest
from fleet.schemas.models import BUILTIN_SPECS
from tests.processes import ROOT, fleet_env, fleet_process, wait_http_ready

DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
MARKER = re.compile(r"^<!-- check: ([\w-]+)(?: ([\w.]+))? -->$")
FENCE = re.compile(r"^```(\w*)")
KINDS = {"python", "python-gateway", "shell", "shell-gateway", "dag", "json", "manifest"}
DOC_URL = "http://127.0.0.1:8000"


@dataclass(frozen=True)
class Example:
    path: Path
    line: int  # of the marker, 1-based
    kind: str
    arg: str | None
    language: str
    code: str

    @property
    def where(self) -> str:
        return f"{rel(self.path)}:{self.line}"


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def parse(path: Path) -> tuple[list[Example], list[str]]:
    """The marked examples of one file, and what is wrong with its markers."""
    lines = path.read_text(encoding="utf-8").splitlines()
    examples, problems = [], []
    for i, line in enumerate(lines):
        match = MARKER.match(line.strip())
        if not match:
            if line.strip().startswith("<!-- check"):
                problems.append(f"{rel(path)}:{i + 1}: malformed marker {line.strip()!r}")
            continue
        kind, arg = match.groups()
        where = f"{rel(path)}:{i + 1}"
        if kind not in KINDS:
            problems.append(f"{where}: unknown check {kind!r}; known: {', '.join(sorted(KINDS))}")
            continue
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if not fence:
            problems.append(f"{where}: the marker is not followed by a ``` code block on the next line")
            continue
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            problems.append(f"{where}: the code block never closes")
            continue
        code = "\n".join(lines[i + 2 : end]) + "\n"
        examples.append(Example(path, i + 1, kind, arg, fence.group(1), code))
    return examples, problems


def collect() -> tuple[list[Example], list[str]]:
    examples, problems = [], []
    for path in DOC_FILES:
        found, wrong = parse(path)
        examples += found
        problems += wrong
    return examples, problems


EXAMPLES, PROBLEMS = collect()


def examples_of(*kinds: str) -> list[pytest.param]:
    return [pytest.param(e, id=f"{e.where}-{e.kind}") for e in EXAMPLES if e.kind in kinds]


# -- the markers themselves -----------------------------------------------------------------------------------
def test_every_marker_names_a_known_check_and_precedes_a_code_block() -> None:
    assert not PROBLEMS, "\n".join(PROBLEMS)


def test_the_parser_refuses_a_marker_without_a_block_and_an_unknown_check(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- check: python -->\ntext\n\n<!-- check: pyhton -->\n```python\n```\n", encoding="utf-8")
    examples, problems = parse(page)
    assert examples == []
    assert len(problems) == 2 and "not followed by" in problems[0] and "unknown check 'pyhton'" in problems[1]


def test_the_docs_mark_examples_of_every_kind() -> None:
    kinds = {e.kind for e in EXAMPLES}
    assert kinds == KINDS, f"no example marked {KINDS - kinds}"
    assert len(examples_of("python-gateway")) >= 4


def test_the_docs_are_no_lab_notebook() -> None:
    """Measured figures belong in benchmark result files; no load averages, issue numbers or commits in prose."""
    banned = [r"load average", r"\bissue \d+", r"\bcommit `?[0-9a-f]{7}", r"`[0-9a-f]{7}`"]
    found = [
        f"{rel(path)}:{n}: {line.strip()[:100]}"
        for path in DOC_FILES
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if any(re.search(pattern, line, re.IGNORECASE) for pattern in banned)
    ]
    assert not found, "\n".join(found)


# -- the site -------------------------------------------------------------------------------------------------
def test_the_site_builds_strictly_with_its_generated_reference(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**fleet_env(), "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    pages = {p.relative_to(site).as_posix(): p.read_text(encoding="utf-8") for p in site.rglob("*.html")}
    assert not [name for name, html in pages.items() if "<!-- fleet:" in html]
    assert "FLEET_BROKER_URL" in pages["reference/settings/index.html"]
    assert "FLEET_LOG_LEVEL" in pages["reference/settings/index.html"]
    assert "fleet dag validate --help" in pages["reference/cli/index.html"]
    assert "/v1/dags/{name}/runs" in pages["reference/rest/index.html"]
    assert "request-message.schema.json" in pages["reference/schemas/index.html"]
    assert "helm install fleet" in pages["guides/kubernetes/index.html"]
    assert (site / "reference" / "openapi.json").stat().st_size > 10_000


# -- JSON, YAML and DAG examples ------------------------------------------------------------------------------
@pytest.mark.parametrize("example", examples_of("json"))
def test_json_example(example: Example) -> None:
    value = strict_json.loads(example.code, f"the example at {example.where}")
    if example.arg:
        module, _, name = example.arg.rpartition(".")
        getattr(importlib.import_module(module), name).model_validate(value)


@pytest.mark.parametrize("example", examples_of("manifest"))
def test_manifest_example(example: Example) -> None:
    parse_manifest(example.code.encode(), example.where)


@pytest.mark.parametrize("example", examples_of("dag"))
def test_dag_example(example: Example) -> None:
    validate(load_spec(example.code), BUILTIN_SPECS)


def test_the_dsl_example_is_the_triage_dag() -> None:
    """The DSL section's example: what tests/test_dag_spec.py once read from the README."""
    (example,) = [e for e in EXAMPLES if e.kind == "dag" and e.path.name == "dags.md"]
    assert validate(load_spec(example.code), BUILTIN_SPECS).order == ("split", "embed_each", "collect", "many")


# -- shell examples -------------------------------------------------------------------------------------------
@pytest.fixture
def shell_dir(tmp_path: Path) -> Path:
    """A folder to run shell examples in: `fleet` is this checkout's, and dags/examples is there."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "fleet"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m fleet.cli "$@"\n', encoding="utf-8")
    shim.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    (work / "dags").symlink_to(ROOT / "dags")
    return work


def console_steps(code: str) -> Iterator[tuple[str, list[str]]]:
    command: str | None = None
    expected: list[str] = []
    for line in code.splitlines():
        if line.startswith("$ "):
            if command is not None:
                yield command, expected
            command, expected = line[2:], []
        elif line.strip() and command is not None:
            expected.append(line.strip())
    if command is not None:
        yield command, expected


def run_shell(example: Example, shell_dir: Path, gateway: str | None = None) -> None:
    env = fleet_env(PATH=f"{shell_dir.parent / 'bin'}{os.pathsep}{os.environ['PATH']}")
    code = example.code
    if gateway:
        env["FLEET_URL"] = gateway
        code = code.replace(DOC_URL, gateway)
    steps = list(console_steps(code)) if example.language == "console" else [(code, [])]
    assert steps, f"{example.where}: no command in the block"
    for command, expected in steps:
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", command],
            cwd=shell_dir,
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert result.returncode == 0, (
            f"{example.where}: {command!r} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
        for line in expected:
            assert line in result.stdout, f"{example.where}: {command!r} did not print {line!r}:\n{result.stdout}"


@pytest.mark.parametrize("example", examples_of("shell"))
def test_shell_example(example: Example, shell_dir: Path) -> None:
    run_shell(example, shell_dir)


@pytest.mark.timeout(240)  # the first one waits for `fleet up` to load embed
@pytest.mark.parametrize("example", examples_of("shell-gateway"))
def test_shell_example_against_fleet_up(example: Example, shell_dir: Path, fleet_up: str) -> None:
    run_shell(example, shell_dir, fleet_up)


# -- Python examples ------------------------------------------------------------------------------------------
async def run_python(example: Example, source: str) -> None:
    code = compile(source, example.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    namespace: dict[str, object] = {"__name__": f"docs_example_{example.line}"}
    if code.co_flags & inspect.CO_COROUTINE:
        await eval(code, namespace)
    else:  # blocking code (the synchronous client) runs off the test's event loop
        await asyncio.to_thread(exec, code, namespace)


@pytest.mark.parametrize("example", examples_of("python"))
async def test_python_example(example: Example) -> None:
    assert DOC_URL not in example.code, f"{example.where} talks to a gateway: mark it python-gateway"
    await run_python(example, example.code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def fleet_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`fleet up` as `make up` runs it (echo, sleep and embed, embedded broker and store), on a free port."""
    port = free_port()
    log = tmp_path_factory.mktemp("fleet-up") / "fleet-up.log"
    with fleet_process("up", "--port", str(port), log=log) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_http_ready(f"{url}/readyz", proc, log, timeout_s=100)
        yield url


@pytest.mark.timeout(240)  # the first one waits for `fleet up` to load embed, slower on a loaded machine
@pytest.mark.parametrize("example", examples_of("python-gateway"))
async def test_python_example_against_fleet_up(
    example: Example, fleet_up: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert DOC_URL in example.code, f"{example.where} names no gateway at {DOC_URL}"
    monkeypatch.chdir(ROOT)  # examples read dags/examples/... as a user in the checkout would
    await asyncio.wait_for(run_python(example, example.code.replace(DOC_URL, fleet_up)), timeout=60)


# -- the benchmark page ---------------------------------------------------------------------------------------
def docs_hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_page_is_made_from_the_result_files(tmp_path: Path) -> None:
    from benchmarks.catalogue import BENCHMARKS
    from benchmarks.report import NOT_MEASURED, RESULTS_DIR, render_markdown

    page = docs_hooks().benchmarks_markdown(RESULTS_DIR)
    assert page == render_markdown(RESULTS_DIR)
    assert all(benchmark.name in page for benchmark in BENCHMARKS)
    assert docs_hooks().benchmarks_markdown(tmp_path).count(NOT_MEASURED) == len(BENCHMARKS)  # no files yet
