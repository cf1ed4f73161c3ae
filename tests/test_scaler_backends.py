"""Scaler backends: real ``fleet worker`` processes on NATS + Redis, in-process workers on the memory broker, and
the kubernetes backend through the official client against a real control plane (``tests/kube_service.py``:
kube-apiserver with RBAC, the controller manager and kwok's fake nodes, so pods start, terminate and conflict)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from fleet import constants as c
from fleet.autoscaler.backends import BACKENDS, ScalerBackend, default_backend_name, make_backend
from fleet.autoscaler.backends.dry_run import DryRunBackend
from fleet.autoscaler.backends.inprocess import InProcessBackend
from fleet.autoscaler.backends.kubernetes import KubernetesBackend
from fleet.autoscaler.backends.process import ProcessBackend, settings_env
from fleet.brokers.base import Broker
from fleet.consumers.handlers import with_name
from fleet.consumers.worker import Worker
from fleet.errors import ConfigError, ScalerError
from fleet.schemas.jobs import JobState
from fleet.schemas.wire import Heartbeat
from fleet.store.base import ResultStore
from tests.handlers_for_tests import Items
from tests.infra import connected_pair, count_completions, eventually, publish_requests, settings_for, wait_terminal
from tests.kube_service import KubeCluster, create_namespace, service_account_token
from tests.processes import ROOT, fleet_process, wait_http_ready
from tests.services import free_port

WORKER = "tests.handlers_for_tests:Items"
NS = "fleet"


# -- make_backend and dry-run ------------------------------------------------------------------------------------
def test_an_unknown_backend_name_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        make_backend("docker", settings_for("memory", {}))
    assert "'docker'" in info.value.message
    assert all(name in info.value.message for name in BACKENDS)


def test_the_process_backend_refuses_the_memory_broker_and_points_to_inprocess() -> None:
    settings = settings_for("memory", {})
    assert default_backend_name(settings) == "inprocess"
    with pytest.raises(ConfigError, match="inprocess"):
        make_backend("process", settings)


def test_missing_backend_arguments_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match="namespace"):
        make_backend("kubernetes", settings_for("memory", {}))


async def test_dry_run_records_every_call_and_reports_the_last(unique: str) -> None:
    backend = make_backend("dry-run", settings_for("memory", {}), initial={"b": 2})
    assert isinstance(backend, DryRunBackend) and isinstance(backend, ScalerBackend)
    assert (await backend.current_replicas("a"), await backend.current_replicas("b")) == (0, 2)
    for replicas in (3, 1, 0):
        await backend.set_replicas("a", replicas)
    assert [(call.model, call.replicas) for call in backend.calls] == [("a", 3), ("a", 1), ("a", 0)]
    assert backend.calls[0].at <= backend.calls[-1].at
    assert await backend.current_replicas("a") == 0
    with pytest.raises(ValueError, match="replicas for model 'a'"):
        await backend.set_replicas("a", -1)
    await backend.close()
    await backend.close()


def test_workers_get_the_broker_store_and_only_the_settings_that_were_set(nats_url: str, redis_url: str) -> None:
    settings = settings_for("nats+redis", {"nats": nats_url, "redis": redis_url}, max_batch=4, port=9999)
    env = settings_env(settings)
    assert env["FLEET_BROKER_URL"] == nats_url and env["FLEET_STORE_URL"] == redis_url
    assert env["FLEET_MAX_BATCH"] == "4" and env["FLEET_ACK_WAIT_S"] == "2.0"
    assert "FLEET_PORT" not in env and "FLEET_MODELS" not in env
    assert "FLEET_MAX_MESSAGE_BYTES" not in env, "a default stays a default (the model's preferences apply)"


# -- process: real `fleet worker` processes ------------------------------------------------------------------------


async def watch_heartbeats(broker: Broker, model: str, states: dict[int, str]) -> None:
    """The latest state each worker process (by pid) announced."""
    stream = await broker.listen(c.heartbeat_subject(model))
    try:
        async for _, data in stream:
            beat = Heartbeat.model_validate_json(data)
            states[beat.pid] = beat.state
    finally:
        await stream.close()


@contextlib.asynccontextmanager
async def background(*coros: Any) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(coro) for coro in coros]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def succeeded(records: dict[str, Any]) -> int:
    return sum(1 for r in records.values() if r is not None and r.state is JobState.succeeded)


@pytest.mark.slow
async def test_process_backend_scales_real_workers_and_scale_in_loses_no_job(
    nats_url: str, redis_url: str, unique: str, tmp_path: Path
) -> None:
    model = f"scale-{unique}"
    settings = settings_for(
        "nats+redis", {"nats": nats_url, "redis": redis_url}, max_batch=4, max_wait_ms=20, drain_timeout_s=20
    )
    env = {"FLEET_TEST_MODEL_NAME": model, "PYTHONPATH": str(ROOT)}
    backend = make_backend("process", settings, refs={model: WORKER}, env=env, log_dir=tmp_path)
    assert isinstance(backend, ProcessBackend)
    counts: collections.Counter[str] = collections.Counter()
    states: dict[int, str] = {}
    ready = asyncio.Event()
    async with connected_pair(settings) as (broker, store):
        async with background(count_completions(redis_url, ready, counts), watch_heartbeats(broker, model, states)):
            await ready.wait()
            try:
                await _scale_through_a_burst(backend, broker, store, model, unique, counts, states)
                await _a_crashed_worker_is_noticed_and_replaced(backend, model)
            finally:
                survivors = backend.workers(model)
                await backend.close()
            assert all(w.process.returncode is not None for w in survivors), "close() stops every worker"
            assert await backend.current_replicas(model) == 0 and not backend.draining(model)
            with pytest.raises(ScalerError, match="closed"):
                await backend.set_replicas(model, 1)


async def _scale_through_a_burst(
    backend: ProcessBackend,
    broker: Broker,
    store: ResultStore,
    model: str,
    unique: str,
    counts: collections.Counter[str],
    states: dict[int, str],
) -> None:
    assert await backend.current_replicas(model) == 0
    await backend.set_replicas(model, 2)
    assert await backend.current_replicas(model) == 2
    pids = [w.pid for w in backend.workers(model)]

    async def all_ready() -> bool:
        return all(states.get(pid) == "ready" for pid in pids)

    try:
        await eventually(all_ready, timeout_s=60, what="both worker processes ready (heartbeats)")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{worker_logs(backend, model)}") from None
    ids = await publish_requests(broker, model, [{"value": i, "sleep_ms": 100} for i in range(40)], unique)

    async def mid_burst() -> bool:
        return succeeded({j: await store.get(j) for j in ids}) >= 8

    await eventually(mid_burst, timeout_s=30, what="the burst under way")
    victim = backend.workers(model)[-1]
    await backend.set_replicas(model, 1)
    assert await backend.current_replicas(model) == 1
    assert backend.draining(model) == [victim], "scale-in stops the newest worker"

    records = await wait_terminal(store, ids, timeout_s=60)
    assert [records[j].output["value"] for j in ids] == [2 * i for i in range(40)]
    assert {r.state for r in records.values()} == {JobState.succeeded}
    assert len({r.worker_id for r in records.values()}) == 2, "both processes served the burst"
    await eventually(lambda: _is_reaped(backend, model), timeout_s=30, what="the drained worker reaped")
    assert victim.process.returncode == 0 and states[victim.pid] == "stopped", "drained, not killed"
    await asyncio.sleep(0.5)  # let a duplicate completion, if any, arrive before counting
    assert {j: counts[j] for j in ids} == dict.fromkeys(ids, 1), "exactly one terminal result per job"
    lag = await broker.lag(c.request_subject(model), c.consumer_name(model))
    assert lag == 0, "every message was acked"


def worker_logs(backend: ProcessBackend, model: str) -> str:
    paths = sorted(backend.log_dir.glob(f"{model}-*.log")) if backend.log_dir is not None else []
    return "\n".join(f"--- {p.name}:\n{p.read_text()[-2000:]}" for p in paths)


async def _is_reaped(backend: ProcessBackend, model: str) -> bool:
    return not backend.draining(model)


async def _a_crashed_worker_is_noticed_and_replaced(backend: ProcessBackend, model: str) -> None:
    (survivor,) = backend.workers(model)
    os.kill(survivor.pid, signal.SIGKILL)

    async def noticed() -> bool:
        return await backend.current_replicas(model) == 0

    await eventually(noticed, timeout_s=10, what="the crashed worker no longer counted")
    await backend.set_replicas(model, 1)
    (replacement,) = backend.workers(model)
    assert replacement.pid != survivor.pid and replacement.alive


# -- inprocess: Worker objects on the embedded memory broker -------------------------------------------------------
def children_of(pid: int) -> set[int]:
    """The live child processes of ``pid`` (Linux's /proc/<pid>/task/<tid>/children)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found |= {int(p) for p in (task / "children").read_text().split()}
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited (init reaps it)


def test_the_workers_of_a_killed_fleet_up_drain_and_exit(nats_url: str, redis_url: str, tmp_path: Path) -> None:
    """fleet up on real infrastructure starts its workers as processes (the process backend): SIGKILLed, it
    leaves none of them serving on (PR_SET_PDEATHSIG sends each SIGTERM, and they drain)."""
    port, log = free_port(), tmp_path / "up.log"
    args = ("up", "--port", str(port), "--models", "echo", "--broker", nats_url, "--store", redis_url)
    env = {"FLEET_AUTOSCALE_INTERVAL_S": "0.5"}  # the scaling lock lapses 5 s after this fleet up dies
    with fleet_process(*args, env=env, log=log) as proc:
        wait_http_ready(f"http://127.0.0.1:{port}/readyz", proc, log, timeout_s=120)
        workers = children_of(proc.pid)
        assert workers, f"fleet up started no worker process:\n{log.read_text()[-2000:]}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    deadline = time.monotonic() + 30  # SIGTERM, then the drain (no job in flight) and the interpreter's exit
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(w) for w in workers), f"workers {sorted(w for w in workers if alive(w))} outlived fleet up"


async def test_inprocess_backend_drains_workers_without_losing_a_job(unique: str) -> None:
    settings = settings_for("memory", {})
    model = f"inproc-{unique}"
    async with connected_pair(settings) as (broker, store):
        started: list[Worker] = []

        async def start_worker(name: str) -> Worker:
            worker = Worker(with_name(Items, name)(), broker, store, settings=settings, max_batch=4, max_wait_ms=10)
            await worker.start()
            started.append(worker)
            return worker

        backend = make_backend("inprocess", settings, start_worker=start_worker)
        assert isinstance(backend, InProcessBackend)
        await backend.set_replicas(model, 3)
        assert await backend.current_replicas(model) == 3 and len(started) == 3
        ids = await publish_requests(broker, model, [{"value": i, "sleep_ms": 50} for i in range(30)], unique)

        async def mid_burst() -> bool:
            return succeeded({j: await store.get(j) for j in ids}) >= 6

        await eventually(mid_burst, timeout_s=20, what="the burst under way")
        await backend.set_replicas(model, 1)
        assert await backend.current_replicas(model) == 1
        records = await wait_terminal(store, ids, timeout_s=30)
        await eventually(_async(lambda: backend.draining() == 0), what="the drained workers stopped")
        assert [w.state for w in started] == ["ready", "stopped", "stopped"], "the newest workers were stopped"
        assert {r.state for r in records.values()} == {JobState.succeeded}
        computed = sorted(v for w in started for v in w.handler.predicted)  # type: ignore[attr-defined]
        assert computed == list(range(30)), "every job computed once: none lost, none repeated"
        await backend.close()
        await backend.close()
        assert [w.state for w in started] == ["stopped"] * 3


async def test_inprocess_backend_keeps_the_workers_that_started_when_one_fails(unique: str) -> None:
    stopped: list[int] = []

    class Fake:
        def __init__(self, n: int) -> None:
            self.n = n

        async def stop(self) -> None:
            stopped.append(self.n)

    attempts = iter(range(10))

    async def start_worker(model: str) -> Fake:
        n = next(attempts)
        if n == 1:
            raise RuntimeError("no device left")
        return Fake(n)

    backend = InProcessBackend(start_worker)
    with pytest.raises(ScalerError, match="1 of 3 workers for model 'm' failed to start") as info:
        await backend.set_replicas("m", 3)
    assert info.value.retriable
    assert await backend.current_replicas("m") == 2
    await backend.close()
    assert sorted(stopped) == [0, 2]


async def test_inprocess_forgets_a_worker_that_an_operator_drained() -> None:
    class Fake:
        state = "ready"

        async def stop(self) -> None:
            self.state = "stopped"

    started: list[Fake] = []

    async def start_worker(model: str) -> Fake:
        started.append(Fake())
        return started[-1]

    backend = InProcessBackend(start_worker)
    await backend.set_replicas("m", 2)
    started[0].state = "draining"  # the worker runs its own stop (POST /v1/workers/{id}/drain)
    assert await backend.current_replicas("m") == 1
    await backend.set_replicas("m", 2)  # the autoscaler replaces it
    assert len(started) == 3 and await backend.current_replicas("m") == 2
    await backend.close()


def _async(check: Any) -> Any:
    async def wrapped() -> bool:
        return bool(check())

    return wrapped


# -- kubernetes: the official client against a real kube-apiserver (tests/kube_service.py) ---------------------------
def deployment(name: str, replicas: int) -> dict[str, Any]:
    """Its pods stand for processes that ignore SIGTERM: they stay Terminating for their 2 s grace period
    (``fleet.test/terminate``: scripts/kube/kwok-stages.yaml)."""
    labels = {"app.kubernetes.io/name": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": {**labels, "fleet.test/terminate": "process"}},
                "spec": {"terminationGracePeriodSeconds": 2, "containers": [{"name": "w", "image": "fleet-inference"}]},
            },
        },
    }


@pytest.fixture
def kube_ns(kube: KubeCluster) -> Iterator[tuple[client.ApiClient, str]]:
    """The admin's ApiClient and a fresh namespace."""
    with kube.api_client() as api:
        namespace = f"{NS}-{uuid.uuid4().hex[:6]}"
        create_namespace(api, namespace)
        yield api, namespace


@pytest.fixture
async def k8s_backend(kube_ns: tuple[client.ApiClient, str]) -> AsyncIterator[KubernetesBackend]:
    api, namespace = kube_ns
    backend = make_backend("kubernetes", settings_for("memory", {}), namespace=namespace, api_client=api)
    assert isinstance(backend, KubernetesBackend)
    yield backend
    await backend.close()


def scale_of(api: client.ApiClient, namespace: str, name: str) -> tuple[int, int, str]:
    """spec.replicas, status.replicas and resourceVersion of a Deployment's scale."""
    scale = client.AppsV1Api(api).read_namespaced_deployment_scale(name, namespace)
    return scale.spec.replicas, scale.status.replicas, scale.metadata.resource_version


def settled_version(api: client.ApiClient, namespace: str, name: str, replicas: int) -> str | None:
    """The Deployment's resourceVersion once the controller has nothing left to write: its status counts all equal
    ``replicas`` for the current generation, and a second read half a second later finds the same version. None
    until then (the controller writes the ready, available and condition fields after status.replicas)."""
    apps = client.AppsV1Api(api)
    first = apps.read_namespaced_deployment(name, namespace)
    status = first.status
    counts = (status.replicas, status.updated_replicas, status.ready_replicas, status.available_replicas)
    if counts != (replicas,) * 4 or status.observed_generation != first.metadata.generation:
        return None
    time.sleep(0.5)
    version: str = apps.read_namespaced_deployment(name, namespace).metadata.resource_version
    return version if version == first.metadata.resource_version else None


def running(api: client.ApiClient, namespace: str, name: str) -> tuple[int, int]:
    """(pods Running and not being deleted, pods being deleted) of the Deployment ``name``."""
    pods = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=f"app.kubernetes.io/name={name}").items
    deleting = sum(1 for p in pods if p.metadata.deletion_timestamp is not None)
    return sum(1 for p in pods if p.status.phase == "Running" and p.metadata.deletion_timestamp is None), deleting


async def test_kubernetes_backend_scales_a_real_deployment_out_and_in(kube_ns, k8s_backend) -> None:
    api, namespace = kube_ns
    name = "fleet-worker-embed-v2"
    client.AppsV1Api(api).create_namespaced_deployment(namespace, deployment(name, 1))
    assert await k8s_backend.current_replicas("embed_v2") == 1
    await k8s_backend.set_replicas("embed_v2", 4)
    assert await k8s_backend.current_replicas("embed_v2") == 4, "spec.replicas at once, whatever status says"
    await eventually(_async(lambda: running(api, namespace, name) == (4, 0)), 30, "4 pods Running on kwok nodes")
    await eventually(_async(lambda: settled_version(api, namespace, name, 4) is not None), 30, "the status settled")
    version = scale_of(api, namespace, name)[2]
    await k8s_backend.set_replicas("embed_v2", 4)
    assert scale_of(api, namespace, name)[2] == version, "a patch that changes nothing writes nothing"
    await k8s_backend.set_replicas("embed_v2", 1)
    assert await k8s_backend.current_replicas("embed_v2") == 1
    await eventually(_async(lambda: running(api, namespace, name)[1] == 3), 10, "3 pods Terminating (grace period)")
    await eventually(_async(lambda: running(api, namespace, name) == (1, 0)), 30, "the terminated pods gone")
    await k8s_backend.set_replicas("embed_v2", 0)
    await eventually(_async(lambda: running(api, namespace, name) == (0, 0)), 30, "scaled to zero")


async def test_a_stale_replace_conflicts_while_the_backends_patch_never_does(kube_ns, k8s_backend) -> None:
    """kube-apiserver's optimistic concurrency: a read-modify-replace of the scale with a resourceVersion that the
    controller manager (or anyone) has since moved gets 409; the backend's merge patch carries no version."""
    api, namespace = kube_ns
    apps = client.AppsV1Api(api)
    apps.create_namespaced_deployment(namespace, deployment("fleet-worker-sleep", 1))
    stale = apps.read_namespaced_deployment_scale("fleet-worker-sleep", namespace)
    await k8s_backend.set_replicas("sleep", 3)
    stale.spec.replicas = 5
    with pytest.raises(client.ApiException) as info:
        apps.replace_namespaced_deployment_scale("fleet-worker-sleep", namespace, stale)
    assert info.value.status == 409 and "the object has been modified" in info.value.body
    for replicas in (2, 4, 1, 3, 2, 5, 1):  # while the controllers write the status between them
        await k8s_backend.set_replicas("sleep", replicas)
        await asyncio.sleep(0.05)
    assert await k8s_backend.current_replicas("sleep") == 1
    assert scale_of(api, namespace, "fleet-worker-sleep")[0] == 1


async def test_kubernetes_backend_names_a_missing_deployment(k8s_backend) -> None:
    with pytest.raises(ScalerError) as info:
        await k8s_backend.current_replicas("sleep")
    assert f"{k8s_backend.namespace}/fleet-worker-sleep not found" in info.value.message
    assert not info.value.retriable
    with pytest.raises(ScalerError, match="fleet-worker-sleep not found"):
        await k8s_backend.set_replicas("sleep", 2)


async def test_kubernetes_backend_explains_a_forbidden_patch(kube: KubeCluster, kube_ns) -> None:
    """A service account whose Role grants only ``get`` on ``deployments/scale``, with a token from TokenRequest."""
    api, namespace = kube_ns
    client.AppsV1Api(api).create_namespaced_deployment(namespace, deployment("fleet-worker-sleep", 2))
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "viewer"}})
    rule = {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get"]}
    rbac.create_namespaced_role(namespace, {"metadata": {"name": "viewer"}, "rules": [rule]})
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "viewer"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "viewer"},
            "subjects": [{"kind": "ServiceAccount", "name": "viewer", "namespace": namespace}],
        },
    )
    with kube.api_client(service_account_token(api, namespace, "viewer")) as read_only:
        backend = KubernetesBackend(namespace, api_client=read_only)
        assert await backend.current_replicas("sleep") == 2
        with pytest.raises(ScalerError) as info:
            await backend.set_replicas("sleep", 3)
    assert f"not allowed to patch the scale of deployment {namespace}/fleet-worker-sleep (403" in info.value.message
    assert "deployments/scale" in info.value.message and not info.value.retriable
    assert scale_of(api, namespace, "fleet-worker-sleep")[0] == 2
    with kube.api_client("not-a-token") as stranger:
        with pytest.raises(ScalerError) as info:
            await KubernetesBackend(namespace, api_client=stranger).current_replicas("sleep")
    assert "(401" in info.value.message and not info.value.retriable


async def test_kubernetes_backend_loads_a_kubeconfig_file(kube: KubeCluster, kube_ns, tmp_path: Path) -> None:
    api, namespace = kube_ns
    client.AppsV1Api(api).create_namespaced_deployment(namespace, deployment("workers-echo", 1))
    kubeconfig = kube.kubeconfig(tmp_path / "config")
    backend = KubernetesBackend(namespace, "workers-{model}", kubeconfig=str(kubeconfig))
    await backend.set_replicas("echo", 3)
    assert await backend.current_replicas("echo") == 3
    await backend.close()
    await backend.close()
    with pytest.raises(ConfigError, match="no cluster credentials"):
        KubernetesBackend(NS, kubeconfig=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"must contain '\{model\}'"):
        KubernetesBackend(NS, "workers", kubeconfig=str(kubeconfig))


async def test_an_unreachable_api_server_is_a_retriable_error(kube: KubeCluster) -> None:
    configuration = kube.configuration()
    configuration.host = f"https://127.0.0.1:{free_port()}"  # nothing listens there
    configuration.retries = 0
    with client.ApiClient(configuration) as api:
        backend = KubernetesBackend(NS, api_client=api, request_timeout_s=2)
        with pytest.raises(ScalerError, match="unreachable") as info:
            await backend.current_replicas("sleep")
    assert info.value.retriable
