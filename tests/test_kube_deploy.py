"""The Helm chart on a real Kubernetes control plane (``tests/kube_service.py``: etcd, kube-apiserver, controller
manager, scheduler, kwok): every rendered object is accepted by server-side apply with strict field validation and
the Deployments' pods run on kwok nodes; ``helm install`` / ``upgrade`` / ``uninstall`` work as the deploy guide
says; the KEDA ScaledObjects are accepted once KEDA's CRD (from its sources) is installed; the autoscaler's service
account, with the chart's Role, may change the scale of its worker Deployments and nothing else."""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from fleet.autoscaler.backends.kubernetes import KubernetesBackend
from fleet.errors import ScalerError
from tests import deploy_tools
from tests.infra import until
from tests.kube_service import KubeCluster, apply, create_namespace, dynamic, service_account_token
from tests.test_deploy import CHART, SCENARIOS, of_kind, workers

pytestmark = [pytest.mark.timeout(deploy_tools.FETCH_TIMEOUT_S)] if not deploy_tools.cached() else []

Manifest = dict[str, Any]
APPLIED_SCENARIOS = ("defaults", "nats-fleet", "grafana-dashboard", "no-autoscaler")  # no CRD needed
KEDA_SCENARIOS = ("kafka-keda", "nats-keda")


@pytest.fixture(scope="module")
def admin(kube: KubeCluster) -> Iterator[client.ApiClient]:
    with kube.api_client() as api:
        yield api


@pytest.fixture(scope="module")
def dyn(admin: client.ApiClient) -> Any:
    return dynamic(admin)


def fresh_namespace(admin: client.ApiClient, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    create_namespace(admin, name)
    return name


def rendered(namespace: str, *args: str) -> list[Manifest]:
    """``helm template`` of the chart as release ``fleet`` into ``namespace`` for the API server's version."""
    import yaml

    proc = deploy_tools.run_helm(
        "template", "fleet", str(CHART), "--namespace", namespace, "--kube-version", "1.37.2", *args
    )
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def running_pods(admin: client.ApiClient, namespace: str, deployment: Manifest) -> list[client.V1Pod]:
    labels = deployment["spec"]["selector"]["matchLabels"]
    selector = ",".join(f"{k}={v}" for k, v in labels.items())
    pods = client.CoreV1Api(admin).list_namespaced_pod(namespace, label_selector=selector).items
    return [p for p in pods if p.status.phase == "Running" and p.metadata.deletion_timestamp is None]


def diagnosis(kube: KubeCluster, admin: client.ApiClient, namespace: str) -> str:
    """What the control plane says of a namespace whose pods did not come up: the Deployments' conditions, each
    pod's phase, node and conditions, the nodes' readiness, and the tails of the scheduler's, controller manager's
    and kwok's logs."""
    core, apps = client.CoreV1Api(admin), client.AppsV1Api(admin)
    lines = []
    for d in apps.list_namespaced_deployment(namespace).items:
        conditions = [(c.type, c.status, c.reason) for c in d.status.conditions or []]
        lines.append(f"deployment {d.metadata.name}: {d.status.to_dict()!r:.400} {conditions}")
    for p in core.list_namespaced_pod(namespace).items:
        conditions = [(c.type, c.status, c.reason) for c in p.status.conditions or []]
        lines.append(f"pod {p.metadata.name}: {p.status.phase} on {p.spec.node_name} {conditions}")
    for n in core.list_node().items:
        ready = [(c.status, c.reason) for c in n.status.conditions or [] if c.type == "Ready"]
        lines.append(f"node {n.metadata.name}: ready {ready} taints {[t.key for t in n.spec.taints or []]}")
    for component in ("kube-scheduler", "kube-controller-manager", "kwok"):
        log = (kube.workdir / f"{component}.log") if kube.workdir else None
        if log is not None and log.exists():
            lines.append(f"--- {component}.log (tail)\n{log.read_text(errors='replace')[-1500:]}")
    return "\n".join(lines)


def expected_replicas(deployment: Manifest) -> int:
    return int(deployment["spec"].get("replicas", 1))  # the API server's default when the autoscaler owns it


@pytest.mark.parametrize("scenario", APPLIED_SCENARIOS)
def test_the_rendered_chart_is_accepted_with_strict_validation_and_its_pods_run_on_kwok_nodes(
    scenario: str, kube: KubeCluster, admin: client.ApiClient, dyn: Any
) -> None:
    namespace = fresh_namespace(admin, "chart")
    docs = rendered(namespace, *SCENARIOS[scenario])
    for doc in docs:
        stored = apply(dyn, doc, namespace)
        assert stored["metadata"]["name"] == doc["metadata"]["name"]
    apps = client.AppsV1Api(admin)
    deployments = of_kind(tuple(docs), "Deployment")
    assert deployments, "the chart renders Deployments"
    for deployment in deployments:
        name = deployment["metadata"]["name"]
        want = expected_replicas(deployment)

        def available(name: str = name, want: int = want) -> bool:
            status = apps.read_namespaced_deployment_status(name, namespace).status
            return (status.available_replicas or 0) == want and (status.updated_replicas or 0) == want

        try:  # a second on an idle machine; the full suite loads two cores with the control plane beside it
            until(available, 90, f"deployment {namespace}/{name} available with {want} pods")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{diagnosis(kube, admin, namespace)}") from None
        pods = running_pods(admin, namespace, deployment)
        assert len(pods) == want and {p.spec.node_name for p in pods} <= set(kube.nodes)
        assert all(
            c.image == deployment["spec"]["template"]["spec"]["containers"][0]["image"]
            for p in pods
            for c in p.spec.containers
        )
    config = client.CoreV1Api(admin).read_namespaced_config_map("fleet-config", namespace)
    (rendered_config,) = [d for d in of_kind(tuple(docs), "ConfigMap") if d["metadata"]["name"] == "fleet-config"]
    assert config.data == rendered_config["data"]


def test_strict_validation_refuses_what_the_chart_must_never_render(admin: client.ApiClient, dyn: Any) -> None:
    """The check above cannot pass vacuously: the same apply refuses an unknown field and an invalid value."""
    namespace = fresh_namespace(admin, "strict")
    (worker,) = workers(tuple(rendered(namespace, *SCENARIOS["defaults"]))).values()
    typo = {**worker, "spec": {**worker["spec"], "replicaz": 2}}
    with pytest.raises(client.ApiException) as info:
        apply(dyn, typo, namespace)
    # kube-apiserver answers an apply with an undeclared field with 500 (the typed patch cannot be built)
    assert ".spec.replicaz: field not declared in schema" in info.value.body
    bad_port = copy.deepcopy(worker)
    bad_port["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = 70000
    with pytest.raises(client.ApiException) as info:
        apply(dyn, bad_port, namespace)
    assert info.value.status == 422 and "must be between 1 and 65535" in info.value.body


def test_helm_install_upgrade_and_uninstall_against_the_api_server(
    kube: KubeCluster, admin: client.ApiClient, tmp_path: Path
) -> None:
    """The deploy guide's commands, as written there, against the real API server."""
    namespace = f"fleet-{uuid.uuid4().hex[:6]}"
    kubeconfig = str(kube.kubeconfig(tmp_path / "kubeconfig"))
    base = ["--kubeconfig", kubeconfig, "--namespace", namespace]
    values = ["--set", "broker.url=nats://nats.messaging:4222", "--set", "store.url=redis://redis.data:6379/0"]
    proc = deploy_tools.run_helm(
        "install", "fleet", str(CHART), *base, "--create-namespace", *values, "--wait", "--timeout", "90s"
    )
    assert proc.returncode == 0, proc.stderr
    assert "STATUS: deployed" in proc.stdout
    apps, core = client.AppsV1Api(admin), client.CoreV1Api(admin)
    names = {d.metadata.name for d in apps.list_namespaced_deployment(namespace).items}
    assert names == {"fleet-gateway", "fleet-autoscaler", "fleet-worker-embed"}
    gateway = apps.read_namespaced_deployment("fleet-gateway", namespace)
    before = gateway.spec.template.metadata.annotations["checksum/config"]
    assert core.read_namespaced_config_map("fleet-config", namespace).data["FLEET_BROKER_URL"] == (
        "nats://nats.messaging:4222"
    )

    proc = deploy_tools.run_helm(
        "upgrade",
        "fleet",
        str(CHART),
        *base,
        *values,
        "--set",
        "config.FLEET_LOG_LEVEL=DEBUG",
        "--wait",
        "--timeout",
        "90s",
    )
    assert proc.returncode == 0, proc.stderr
    gateway = apps.read_namespaced_deployment("fleet-gateway", namespace)
    assert gateway.spec.template.metadata.annotations["checksum/config"] != before, "a config change rolls the pods"
    assert core.read_namespaced_config_map("fleet-config", namespace).data["FLEET_LOG_LEVEL"] == "DEBUG"

    def rolled() -> bool:
        pods = running_pods(
            admin,
            namespace,
            {
                "spec": {
                    "selector": {
                        "matchLabels": {"app.kubernetes.io/component": "gateway", "app.kubernetes.io/instance": "fleet"}
                    }
                }
            },
        )
        return len(pods) == 2 and all(
            p.metadata.annotations["checksum/config"] == gateway.spec.template.metadata.annotations["checksum/config"]
            for p in pods
        )

    until(rolled, 30, "the gateway pods replaced with the new config")

    proc = deploy_tools.run_helm("uninstall", "fleet", *base, "--wait", "--timeout", "60s")
    assert proc.returncode == 0, proc.stderr
    until(lambda: not apps.list_namespaced_deployment(namespace).items, 30, "the Deployments removed")
    assert not core.list_namespaced_config_map(namespace, label_selector="app.kubernetes.io/instance=fleet").items


def test_keda_scaled_objects_are_accepted_once_kedas_crd_is_installed(admin: client.ApiClient, dyn: Any) -> None:
    namespace = fresh_namespace(admin, "keda")
    docs = rendered(namespace, *SCENARIOS["kafka-keda"])
    scaled = of_kind(tuple(docs), "ScaledObject")[0]
    crd = deploy_tools.keda().scaledobject_crd
    apply(dyn, crd, namespace)
    extensions = client.ApiextensionsV1Api(admin)

    def established() -> bool:
        conditions = extensions.read_custom_resource_definition(crd["metadata"]["name"]).status.conditions or []
        return any(c.type == "Established" and c.status == "True" for c in conditions)

    until(established, 30, "KEDA's ScaledObject CRD established")
    fresh = dynamic(admin)  # discovery again, now that the API server serves keda.sh/v1alpha1
    for scenario in KEDA_SCENARIOS:
        scenario_namespace = namespace if scenario == "kafka-keda" else fresh_namespace(admin, "keda")
        for doc in rendered(scenario_namespace, *SCENARIOS[scenario]):
            apply(fresh, doc, scenario_namespace)
        objects = client.CustomObjectsApi(admin).list_namespaced_custom_object(
            "keda.sh", "v1alpha1", scenario_namespace, "scaledobjects"
        )["items"]
        expected = of_kind(tuple(rendered(scenario_namespace, *SCENARIOS[scenario])), "ScaledObject")
        assert sorted(o["metadata"]["name"] for o in objects) == sorted(d["metadata"]["name"] for d in expected)
        assert all(o["spec"]["scaleTargetRef"]["name"].startswith("fleet-worker-") for o in objects)
    bad = copy.deepcopy(scaled)
    del bad["spec"]["triggers"][0]["type"]  # the CRD's schema requires it
    with pytest.raises(client.ApiException) as info:
        apply(fresh, bad, namespace)
    assert info.value.status == 422 and "spec.triggers[0].type: Required value" in info.value.body


async def test_the_chart_autoscaler_account_may_scale_its_workers_and_nothing_else(
    kube: KubeCluster, admin: client.ApiClient, dyn: Any
) -> None:
    """The kubernetes backend with the token a pod of the chart's autoscaler gets (TokenRequest for its
    ServiceAccount) and the chart's Role: the scale of each worker Deployment, nothing else."""
    namespace = fresh_namespace(admin, "rbac")
    docs = rendered(namespace, *SCENARIOS["nats-fleet"])
    for doc in docs:
        apply(dyn, doc, namespace)
    (account,) = of_kind(tuple(docs), "ServiceAccount")
    token = service_account_token(admin, namespace, account["metadata"]["name"])
    models = sorted(workers(tuple(docs)))
    (autoscaler,) = [d for d in of_kind(tuple(docs), "Deployment") if d["metadata"]["name"] == "fleet-autoscaler"]
    args = autoscaler["spec"]["template"]["spec"]["containers"][0]["args"]
    template = args[args.index("--deployment-template") + 1]
    with kube.api_client(token) as api:
        backend = KubernetesBackend(namespace, template, api_client=api)
        for model in models:
            assert await backend.current_replicas(model) == 1
            await backend.set_replicas(model, 2)
            assert await backend.current_replicas(model) == 2
        with pytest.raises(ScalerError) as info:
            await KubernetesBackend(namespace, "fleet-{model}", api_client=api).set_replicas("gateway", 5)
        assert "not allowed to patch the scale of deployment" in info.value.message and not info.value.retriable
        await backend.close()
        with pytest.raises(client.ApiException) as denied:
            client.CoreV1Api(api).list_namespaced_pod(namespace)
        assert denied.value.status == 403
        with pytest.raises(client.ApiException) as denied:
            client.AppsV1Api(api).read_namespaced_deployment(backend.deployment_name(models[0]), namespace)
        assert denied.value.status == 403, "only the scale subresource, not the Deployment"
    apps = client.AppsV1Api(admin)
    for deployment in workers(tuple(docs)).values():
        assert apps.read_namespaced_deployment(deployment["metadata"]["name"], namespace).spec.replicas == 2
    assert apps.read_namespaced_deployment("fleet-gateway", namespace).spec.replicas == 2
