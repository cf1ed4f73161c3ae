"""The chart on a real control plane, scaling under load: a burst of ``sleep`` jobs makes the chart's autoscaler
(``fleet autoscaler --backend kubernetes``, its service account and Role) scale the chart's worker Deployment from 1
to N pods Running on kwok nodes, and back to 1 once the burst is over; the pods scaled in drain through their
termination (SIGTERM, in-flight jobs finished, exit 0 before the grace period ends) and no job is lost or computed
twice.

The pods' containers run from the chart's default image, the one ``make test`` builds, with podman
(``tests/kube_kubelet.py``: the pod's own command, args and environment from the chart's ConfigMap), on the test's
real NATS and Redis. The controller manager and the scheduler run, so the autoscaler meets what it meets in a
cluster: ``status.replicas`` behind ``spec.replicas``, pods Terminating for a while after a scale-in, and controllers
writing the Deployment between its reads and writes.
"""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from fleet import constants as c
from fleet.schemas.jobs import JobState
from tests import deploy_tools
from tests.image_service import image_ref
from tests.infra import HeartbeatTally, connected_pair, eventually, publish_requests, settings_for, wait_terminal
from tests.kube_kubelet import ContainerKubelet
from tests.kube_service import KubeCluster, apply, create_namespace, dynamic
from tests.test_kube_deploy import rendered

# On a cold machine helm is built first (deploy_tools: minutes); later runs find it cached.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240 if deploy_tools.cached() else deploy_tools.FETCH_TIMEOUT_S)]

JOBS = 160  # 100 ms each: 16 s for one worker
MAX_REPLICAS = 4


def chart(namespace: str, model: str, token: str, nats_url: str, store_url: str, tmp: Path) -> list[dict[str, Any]]:
    import yaml

    values = {
        "broker": {"url": nats_url},
        "store": {"url": store_url},
        "config": {"FLEET_HEARTBEAT_INTERVAL_S": "0.5", "FLEET_MAX_BATCH": "4"},
        "drainTimeoutSeconds": 20,
        "workers": {"models": {"embed": None, model: {"handler": f"kube_handlers:sleep_{token}", "gpu": False}}},
        "autoscaler": {
            "intervalSeconds": 0.5,
            "scaling": {
                "min_replicas": 1,
                "max_replicas": MAX_REPLICAS,
                "target_drain_s": 3,
                "scale_up_interval_s": 0,
                "scale_down_stabilization_s": 4,
            },
        },
    }
    path = tmp / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return rendered(namespace, "-f", str(path))


async def test_a_burst_scales_the_worker_deployment_out_on_kwok_nodes_and_back_in_draining_the_pods(
    kube: KubeCluster, nats_url: str, redis_url: str, unique: str, tmp_path: Path
) -> None:
    model, namespace = f"sleep-{unique}", f"burst-{unique}"
    store_url = f"{redis_url.rstrip('/')}/9"  # a database of its own: the chart's autoscaler takes the default lock
    docs = chart(namespace, model, unique, nats_url, store_url, tmp_path)
    deployment = f"fleet-worker-{model}"
    (worker,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == deployment]
    assert worker["spec"]["template"]["spec"]["containers"][0]["image"] == image_ref(), "the chart's default image"
    with kube.api_client() as admin:
        create_namespace(admin, namespace)
        dyn = dynamic(admin)
        for doc in docs:
            apply(dyn, doc, namespace)
        apps = client.AppsV1Api(admin)
        settings = settings_for("nats+redis", {"nats": nats_url, "redis": store_url})
        seen: list[tuple[int, int, int]] = []  # (spec.replicas, status.replicas, Running pods)
        selector = "app.kubernetes.io/instance=fleet,app.kubernetes.io/component in (worker,autoscaler)"
        async with (
            connected_pair(settings) as (broker, store),
            HeartbeatTally().following(broker, model) as tally,
            ContainerKubelet(kube, namespace, selector, tmp_path) as kubelet,
        ):

            def workers_running() -> list[str]:
                return [p.pod for p in kubelet.running() if p.pod.startswith(deployment) and p.term_sent_at is None]

            async def one_worker_ready() -> bool:
                return len(workers_running()) == 1 and len(tally.items) == 1

            try:
                await eventually(one_worker_ready, 60, "the first worker pod running and beating")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{kubelet.logs()}") from None

            async def watch() -> None:
                while True:
                    scale = await asyncio.to_thread(apps.read_namespaced_deployment_scale, deployment, namespace)
                    seen.append((scale.spec.replicas, scale.status.replicas, len(workers_running())))
                    await asyncio.sleep(0.2)

            watcher = asyncio.create_task(watch())
            ids = await publish_requests(broker, model, [{"mean_ms": 100}] * JOBS, prefix=f"burst-{unique}")
            records = await wait_terminal(store, ids, timeout_s=90)

            async def back_to_one() -> bool:
                scale = await asyncio.to_thread(apps.read_namespaced_deployment_scale, deployment, namespace)
                pods = await asyncio.to_thread(
                    client.CoreV1Api(admin).list_namespaced_pod,
                    namespace,
                    label_selector="app.kubernetes.io/component=worker",
                )
                return scale.spec.replicas == 1 and len(pods.items) == 1 and len(workers_running()) == 1

            try:
                await eventually(back_to_one, 60, "scaled back in to 1 worker pod, the others gone")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\nseen {seen[-10:]}\n{kubelet.logs()}") from None
            watcher.cancel()
            await asyncio.sleep(1.5)  # the survivor's next heartbeats carry its final count
            lag = await broker.lag(c.request_subject(model), c.consumer_name(model))
        drained = [p for p in kubelet.processes.values() if p.term_sent_at is not None and p.pod.startswith(deployment)]

    assert not kubelet.errors, f"the stand-in kubelet failed: {kubelet.errors}"
    assert not kubelet.crashed, f"containers exited unasked: {kubelet.crashed}\n{kubelet.logs()}"
    assert not kubelet.killed, f"pods went while their container still ran: {kubelet.killed}"
    peak = max(running for _, _, running in seen)
    assert peak >= 3, f"no scale-out to 3 or more Running pods: {seen}"
    assert max(spec for spec, _, _ in seen) <= MAX_REPLICAS
    assert {r.state for r in records.values()} == {JobState.succeeded}, "every job succeeded"
    assert len({r.worker_id for r in records.values()}) >= 3, "the new pods served the burst"
    assert tally.total == JOBS, f"items per pod {tally.items}: a job was computed twice or lost"
    assert lag == 0, "every message was acked"
    assert len(drained) >= peak - 1, "every pod scaled in was terminated through its pod"
    for pod in drained:
        assert pod.returncode == 0, f"{pod.pod} exited {pod.returncode} after SIGTERM, not drained:\n{kubelet.logs()}"
        assert pod.exited_at is not None and pod.exited_at - pod.term_sent_at < 25, "drained before the grace period"
    counts = collections.Counter(r.worker_id for r in records.values())
    assert all(worker.startswith(deployment) for worker in counts), counts
