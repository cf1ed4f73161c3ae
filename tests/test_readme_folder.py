"""The README's "A model folder, no code", exactly as written: a classifier folder (a tiny seeded model, the shape a
fine-tuned one has) in a temporary project, then the section's commands run from that folder: ``fleet models add``
writes the repository entry, ``fleet up`` serves it by name, and ``/v1/infer`` answers with its labels."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.processes import ROOT, fleet_env, wait_http_ready
from tests.services import free_port
from tests.tiny_models import SENTIMENT, build_tiny

pytestmark = pytest.mark.services  # it runs `fleet` processes

FLEET = str(Path(sys.executable).parent / "fleet")  # the console script a user runs
SECTION = (ROOT / "README.md").read_text().split("## A model folder, no code", 1)[1].split("\n## ", 1)[0]


def commands() -> list[str]:
    (bash,) = re.findall(r"```bash\n(.*?)```", SECTION, re.S)
    return [line for line in bash.replace("\\\n", " ").splitlines() if line.startswith(("fleet ", "curl "))]


def test_the_readme_serves_a_model_folder_as_written(tmp_path: Path) -> None:
    add, up, curl = commands()
    assert add == "fleet models add ./my-classifier --name sentiment"
    assert up == "fleet up --models echo,sentiment"
    project = tmp_path / "project"
    build_tiny("classification", project / "my-classifier")

    added = subprocess.run(
        [FLEET, *add.split()[1:]], cwd=project, env=fleet_env(), capture_output=True, text=True, timeout=120
    )
    assert added.returncode == 0, added.stderr
    manifest = yaml.safe_load((project / "models" / "sentiment" / "1" / "model.yaml").read_text())
    assert manifest["runtime"] == "classification"
    assert "model.safetensors" in manifest["weights"]["files"]

    port = free_port()
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        argv = [FLEET, *up.split()[1:], "--port", str(port)]
        process = subprocess.Popen(argv, cwd=project, env=fleet_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http_ready(f"http://127.0.0.1:{port}/readyz", process, log, timeout_s=180)
        body = json.loads(re.search(r"-d '(.*)'", curl).group(1))  # type: ignore[union-attr]
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/infer", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            result = json.loads(answer.read())
    finally:
        process.terminate()
        process.wait(timeout=60)
    assert result["model"] == "sentiment"
    [best] = result["output"]["labels"]  # top_k 1 by default
    assert best["label"] in SENTIMENT and 0 < best["score"] <= 1
    assert result["output"]["tokens"] > 0
