"""The README's "Your own model", exactly as written: its code copied into a temporary project, its commands run
from that project's folder (``fleet`` imports model references from the current folder, or ``--app-dir``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.processes import ROOT, fleet_env, wait_http_ready
from tests.services import free_port

pytestmark = pytest.mark.services  # every test runs a `fleet` process

FLEET = str(Path(sys.executable).parent / "fleet")  # the console script a user runs (python -m would add the cwd)

README = (ROOT / "README.md").read_text()
SECTION = README.split("## Your own model", 1)[1].split("\n## ", 1)[0]


def block(language: str) -> str:
    (found, *_) = re.findall(rf"```{language}\n(.*?)```", SECTION, re.S)
    return found


@pytest.fixture
def project(tmp_path: Path) -> Path:
    package = tmp_path / "project" / "mypackage"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(block("python"))
    (tmp_path / "project" / "schemas.py").write_text("raise ImportError('a user module named like Fleet's own')\n")
    return tmp_path / "project"


def infer(port: int, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/infer", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def test_the_readme_example_runs_as_written_in_fleet_up(project: Path, tmp_path: Path) -> None:
    (command, *_) = [line for line in block("bash").splitlines() if line.startswith("fleet up")]
    assert command == "fleet up --models echo,mypackage.models:Length"  # no PYTHONPATH, no flag to remember
    port = free_port()
    argv = [FLEET, *command.split()[1:], "--port", str(port)]
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        process = subprocess.Popen(argv, cwd=project, env=fleet_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http_ready(f"http://127.0.0.1:{port}/readyz", process, log, timeout_s=180)
        answer = infer(port, {"model": "length", "input": {"text": "four"}})
        assert answer["model"] == "length" and answer["output"] == {"length": 4}
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_a_worker_imports_from_app_dir_wherever_it_runs(
    project: Path, tmp_path: Path, nats_url: str, redis_url: str
) -> None:
    port = free_port()
    argv = [FLEET, "worker", "--model", "mypackage.models:Length", "--app-dir", str(project)]
    argv += ["--broker", nats_url, "--store", redis_url, "--metrics-port", str(port)]
    log = tmp_path / "worker.log"
    with log.open("wb") as out:  # started in another folder: only --app-dir names the project
        process = subprocess.Popen(argv, cwd=tmp_path, env=fleet_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http_ready(f"http://127.0.0.1:{port}/readyz", process, log, timeout_s=120)
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_an_app_dir_that_is_not_a_folder_is_one_error_line(tmp_path: Path) -> None:
    argv = [FLEET, "worker", "--model", "mypackage.models:Length", "--app-dir", str(tmp_path / "nope")]
    result = subprocess.run(argv, cwd=tmp_path, env=fleet_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "nope" in result.stderr and "--app-dir" in result.stderr
