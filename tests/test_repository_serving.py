"""A repository entry served end to end: the gateway and a real worker resolve ``name@version`` from the settings'
repository (in memory, and on NATS + Redis; and ``fleet up`` with the repository relative to its app folder), the
job's ``model`` may pin the served version and is refused 404 for another, and a worker refuses to load a tampered
version; a gateway without the folder serves what its workers published."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import redis

from fleet import constants as c
from fleet.cli.compose import build_worker
from fleet.errors import ConfigError, UnknownModel
from fleet.repository.layout import Repository
from fleet.schemas.manifest import ModelManifest
from fleet.store.bundle import Stores
from tests.gateway_helpers import asgi_gateway, error_of, urls_for
from tests.infra import connected_pair, settings_for
from tests.processes import fleet_process, stop, wait_http_ready
from tests.repository_fixtures import handler_entry
from tests.services import free_port

SERVED_PAIRS = ["memory", "nats+redis"]


@pytest.mark.parametrize("pair", SERVED_PAIRS)
async def test_name_at_version_routes_to_the_served_version_and_another_version_is_404(
    request: pytest.FixtureRequest, pair: str, unique: str, tmp_path: Path
) -> None:
    name = f"rw-{unique}"
    handler_entry(tmp_path, name, "1", payload=b"one" * 10)
    handler_entry(tmp_path, name, "2", payload=b"two" * 20)
    settings = settings_for(pair, urls_for(request, pair), models=[f"{name}@1"], model_repository=tmp_path)
    async with connected_pair(settings) as (broker, store), asgi_gateway(settings, broker, store) as (app, client):
        assert app.state.gateway.specs[name].version == "1"
        worker = build_worker(f"{name}@1", broker, store, settings)
        await worker.start()
        try:
            pinned = await client.post("/v1/infer", json={"model": f"{name}@1", "input": {"text": "hi"}})
            assert pinned.status_code == 200, pinned.text
            assert pinned.json()["model"] == name
            assert pinned.json()["output"] == {"text": "HI", "weights_bytes": 30}
            plain = await client.post("/v1/infer", json={"model": name, "input": {"text": "yo"}})
            assert plain.json()["output"] == {"text": "YO", "weights_bytes": 30}
        finally:
            await worker.stop()
        other = await client.post("/v1/jobs", json={"model": f"{name}@2", "input": {"text": "hi"}})
        assert other.status_code == 404
        error = error_of(other)
        assert error["type"] == "unknown_model"
        assert error["message"] == f"model '{name}' is served at version '1' here, not '2'"
        assert error["details"] == {"model": name, "version": "2", "served_version": "1", "known": [name]}
        unknown = await client.post("/v1/jobs", json={"model": "nope@1", "input": {"text": "hi"}})
        assert unknown.status_code == 404 and error_of(unknown)["details"]["known"] == [name]
        invalid = await client.post("/v1/jobs", json={"model": f"{name}@1", "input": {"txt": "hi"}})
        assert invalid.status_code == 422 and error_of(invalid)["type"] == "invalid_input"


async def test_a_worker_refuses_to_load_a_tampered_version_naming_the_file(unique: str, tmp_path: Path) -> None:
    name = f"rw-{unique}"
    folder = handler_entry(tmp_path, name, "1")
    (folder / "weights.safetensors").write_bytes(b"swapped")
    settings = settings_for("memory", {}, models=[name], model_repository=tmp_path)
    async with connected_pair(settings) as (broker, store):
        worker = build_worker(name, broker, store, settings)
        with pytest.raises(ConfigError, match=rf"^model {name}@1: weight file weights.safetensors does not match"):
            await worker.start()


@pytest.mark.services  # a `fleet` process
def test_fleet_up_serves_a_repository_model_from_the_app_folder(unique: str, tmp_path: Path) -> None:
    """``FLEET_MODEL_REPOSITORY`` relative to ``--app-dir``: the gateway and the worker ``fleet up`` starts read the
    same folder, and the job names the version it wants."""
    name = f"rw-{unique}"
    handler_entry(tmp_path / "models", name, "1", payload=b"x" * 7)
    handler_entry(tmp_path / "models", name, "2", payload=b"x" * 9)
    port = free_port()
    env = {"FLEET_MODEL_REPOSITORY": "models", "FLEET_APP_DIR": str(tmp_path)}
    log = tmp_path / "up.log"
    with fleet_process("up", "--port", str(port), "--models", f"echo,{name}", env=env, log=log) as proc:
        base = f"http://127.0.0.1:{port}"
        wait_http_ready(f"{base}/readyz", proc, log)
        answer = httpx.post(f"{base}/v1/infer", json={"model": f"{name}@2", "input": {"text": "up"}}, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["output"] == {"text": "UP", "weights_bytes": 9}
        refused = httpx.post(f"{base}/v1/jobs", json={"model": f"{name}@1", "input": {"text": "up"}}, timeout=30)
        assert refused.status_code == 404 and error_of(refused)["details"]["served_version"] == "2"
        stop(proc)


# -- published manifests: a gateway without the repository folder --------------------------------------------------
@pytest.mark.parametrize("pair", SERVED_PAIRS)
async def test_manifests_round_trip_through_the_store(
    request: pytest.FixtureRequest, pair: str, unique: str, tmp_path: Path
) -> None:
    folder = handler_entry(tmp_path, f"m-{unique}", "3")
    manifest = Repository(tmp_path).get(f"m-{unique}").manifest
    settings = settings_for(pair, urls_for(request, pair))
    async with connected_pair(settings) as (_, store):
        manifests = Stores.beside(store).manifests
        assert await manifests.read(f"m-{unique}") is None
        await manifests.publish(f"m-{unique}", "3", manifest)
        assert await manifests.read(f"m-{unique}") == ("3", manifest)
    assert folder.is_dir()


async def test_a_gateway_without_the_folder_validates_inputs_from_a_published_manifest(
    unique: str, tmp_path: Path
) -> None:
    name = f"clf-{unique}"
    digest = "0" * 64
    manifest = ModelManifest.model_validate(
        {"runtime": "classification", "weights": {"files": {"model.safetensors": digest}}}
    )
    empty = tmp_path / "no-models-here"
    settings = settings_for("memory", {}, models=[f"{name}@4"], model_repository=empty)
    async with connected_pair(settings) as (broker, store):
        stores = Stores.beside(store)
        with pytest.raises(UnknownModel, match=f"unknown model '{name}@4'"):
            async with asgi_gateway(settings, broker, store, stores=stores):
                pass
        await stores.manifests.publish(name, "4", manifest)
        async with asgi_gateway(settings, broker, store, stores=stores) as (app, client):
            assert app.state.gateway.specs[name].version == "4"
            ok = await client.post("/v1/jobs", json={"model": f"{name}@4", "input": {"text": "good"}})
            assert ok.status_code == 202, ok.text
            bad = await client.post("/v1/jobs", json={"model": name, "input": {"txt": "good"}})
            assert bad.status_code == 422 and error_of(bad)["type"] == "invalid_input"
        await stores.manifests.publish(name, "5", manifest)
        with pytest.raises(ConfigError, match=f"model '{name}': version '4' is not in .*published version '5'"):
            async with asgi_gateway(settings, broker, store, stores=stores):
                pass


def test_a_worker_process_publishes_what_a_folderless_gateway_serves(
    nats_url: str, redis_url: str, unique: str, tmp_path: Path
) -> None:
    """``fleet worker --model NAME`` with the repository, ``fleet gateway`` without it, on NATS + Redis."""
    name = f"rw-{unique}"
    handler_entry(tmp_path / "models", name, "1", payload=b"x" * 5)
    env = {"FLEET_BROKER_URL": nats_url, "FLEET_STORE_URL": redis_url}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    worker_env = {**env, "FLEET_MODEL_REPOSITORY": str(tmp_path / "models")}
    gateway_env = {**env, "FLEET_MODEL_REPOSITORY": str(tmp_path / "empty"), "FLEET_MODELS": name}
    with fleet_process("worker", "--model", name, env=worker_env, log=tmp_path / "worker.log") as worker:
        deadline = time.monotonic() + 60
        with redis.Redis.from_url(redis_url) as client:
            while client.hget(c.MODEL_MANIFESTS_KEY, name) is None:
                assert worker.poll() is None and time.monotonic() < deadline, (tmp_path / "worker.log").read_text()
                time.sleep(0.1)
        with fleet_process("gateway", "--port", str(port), env=gateway_env, log=tmp_path / "gw.log") as gateway:
            wait_http_ready(f"{base}/readyz", gateway, tmp_path / "gw.log")
            answer = httpx.post(f"{base}/v1/infer", json={"model": f"{name}@1", "input": {"text": "a"}}, timeout=30)
            assert answer.status_code == 200, answer.text
            assert answer.json()["output"] == {"text": "A", "weights_bytes": 5}
            stop(gateway)
        stop(worker)
