"""The `fleet` command as a user meets it: help, schemas, clear errors, and `fleet up` serving requests."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml

from tests.processes import ROOT, fleet_process, run_fleet, stop, wait_http_ready
from tests.services import free_port


@pytest.mark.services
def test_help_lists_the_commands() -> None:
    result = run_fleet("--help")
    assert result.returncode == 0
    for command in ("up", "worker", "gateway", "publish", "schemas"):
        assert command in result.stdout
    worker_help = run_fleet("worker", "--help")
    assert "--max-batch" in worker_help.stdout and "FLEET_MAX_BATCH" in worker_help.stdout


@pytest.mark.services
def test_schemas_export_writes_the_wire_format(tmp_path: Path) -> None:
    result = run_fleet("schemas", "export", str(tmp_path), env={"FLEET_MODELS": "echo,embed"})
    assert result.returncode == 0, result.stderr
    request = json.loads((tmp_path / "request-message.schema.json").read_text())
    assert set(request["required"]) >= {"job_id", "model", "input"}
    embed_in = json.loads((tmp_path / "models" / "embed.input.schema.json").read_text())
    assert {"text", "texts"} <= set(embed_in["properties"])
    assert (tmp_path / "job-record.schema.json").exists() and (tmp_path / "models" / "echo.output.schema.json").exists()
    # The DAG DSL and the run-start message, for producers and editors outside Python.
    dag_schema = json.loads((tmp_path / "dag-spec.schema.json").read_text())
    for example in sorted((ROOT / "dags" / "examples").glob("*.yaml")):
        jsonschema.validate(yaml.safe_load(example.read_text()), dag_schema)
    with pytest.raises(jsonschema.ValidationError, match="'model' is a required property"):
        jsonschema.validate({"name": "x", "steps": [{"id": "a"}], "output": None}, dag_schema)
    start = json.loads((tmp_path / "dag-start-message.schema.json").read_text())
    jsonschema.validate({"dag": "triage", "input": {"texts": ["a"]}, "run_id": "r1"}, start)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"dag": "triage", "surprise": 1}, start)
    assert {"run_id", "state", "steps"} <= set(json.loads((tmp_path / "run-view.schema.json").read_text())["required"])


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["worker", "--model", "echo", "--broker", "amqp://x"], {}, "scheme 'amqp'"),
        (["worker", "--model", "echo"], {}, "needs a real broker and store"),
        (["worker", "--model", "echo", "--broker", "nats://127.0.0.1:4222"], {}, "--store redis://"),
        (["worker", "--model", "echo", "--broker", "nats://127.0.0.1:1", "--max-batch", "0"], {}, "max_batch"),
        (["up", "--port", "99999"], {}, "port"),
        (["up"], {"FLEET_MAX_WAIT_MS": "5000", "FLEET_ACK_WAIT_S": "2"}, "max_wait_ms"),
        (["schemas", "export", "out", "--models", "nosuchmodel"], {}, "unknown model 'nosuchmodel'"),
        (["schemas", "export", "out", "--models", "nosuch.module:Thing"], {}, "cannot import 'nosuch.module'"),
    ],
)
@pytest.mark.services
def test_bad_configuration_is_refused_with_a_clear_message(args: list[str], env: dict[str, str], expected: str) -> None:
    result = run_fleet(*args, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.services
def test_an_unreachable_broker_fails_fast_with_its_url() -> None:
    args = ("worker", "--model", "echo", "--broker", "nats://127.0.0.1:1", "--store", "redis://127.0.0.1:1")
    result = run_fleet(*args, env={"FLEET_STARTUP_TIMEOUT_S": "0"})  # one attempt: start-up retries are off
    assert result.returncode == 1
    assert "127.0.0.1:1" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.services
def test_fleet_up_serves_echo_and_embed_over_rest(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "up.log"
    base = f"http://127.0.0.1:{port}"
    with fleet_process("up", "--port", str(port), "--models", "echo,embed", log=log) as proc:
        # /readyz waits for the embed model to load and warm up: 20 s on an idle machine, minutes on a loaded one
        wait_http_ready(f"{base}/readyz", proc, log, timeout_s=240)
        with httpx.Client(base_url=base, timeout=30) as http:
            echo = http.post("/v1/jobs", json={"model": "echo", "input": {"hello": "world"}})
            assert echo.status_code == 202, echo.text
            embed = http.post("/v1/jobs", json={"model": "embed", "input": {"texts": ["a cat", "a dog"]}})
            assert embed.status_code == 202, embed.text
            done = http.get(f"/v1/jobs/{echo.json()['job_id']}", params={"wait": 20}).json()
            assert done["state"] == "succeeded" and done["output"] == {"hello": "world"}
            vectors = http.get(f"/v1/jobs/{embed.json()['job_id']}", params={"wait": 30}).json()
            assert vectors["state"] == "succeeded", vectors
            assert [len(v) for v in vectors["output"]["embeddings"]] == [384, 384]
            assert http.get("/docs").status_code == 200
            assert "fleet_worker_items_total" in http.get("/metrics").text
        assert stop(proc, signal.SIGINT) == 0, log.read_text()[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nats", "kafka"])
def test_fleet_up_on_real_infrastructure(kind: str, request: pytest.FixtureRequest, redis_url: str, tmp_path) -> None:
    broker_url = request.getfixturevalue(f"{kind}_url")
    port = free_port()
    log = tmp_path / "up.log"
    base = f"http://127.0.0.1:{port}"
    args = ("up", "--port", str(port), "--models", "echo", "--broker", broker_url, "--store", redis_url)
    with fleet_process(*args, log=log) as proc:
        wait_http_ready(f"{base}/readyz", proc, log)
        with httpx.Client(base_url=base, timeout=30) as http:
            ids = [http.post("/v1/jobs", json={"model": "echo", "input": {"i": i}}).json()["job_id"] for i in range(5)]
            done = [http.get(f"/v1/jobs/{job_id}", params={"wait": 20}).json() for job_id in ids]
        assert [(d["state"], d["output"]) for d in done] == [("succeeded", {"i": i}) for i in range(5)]
        assert stop(proc) == 0, log.read_text()[-2000:]


@pytest.mark.slow
@pytest.mark.services
def test_fleet_up_runs_a_dispatcher_for_models_in_dispatch_routing(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "up.log"
    base = f"http://127.0.0.1:{port}"
    env = {"FLEET_ROUTING": "echo=dispatch"}
    with fleet_process("up", "--port", str(port), "--models", "echo", env=env, log=log) as proc:
        wait_http_ready(f"{base}/readyz", proc, log)
        with httpx.Client(base_url=base, timeout=30) as http:
            ids = [http.post("/v1/jobs", json={"model": "echo", "input": {"i": i}}).json()["job_id"] for i in range(5)]
            done = [http.get(f"/v1/jobs/{job_id}", params={"wait": 20}).json() for job_id in ids]
        assert [(d["state"], d["output"]) for d in done] == [("succeeded", {"i": i}) for i in range(5)]
        assert stop(proc) == 0, log.read_text()[-2000:]
