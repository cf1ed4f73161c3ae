"""A real Kubernetes control plane for the deploy tests: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok, each a process on 127.0.0.1, stopped by PID.

``scripts/kube/build.sh`` builds the five binaries from the Go module proxy once and caches them in a versioned
folder (``make test`` runs it through ``scripts/services.sh`` before the suite). ``kube_cluster`` then:

* starts etcd (v3.6, in a temporary folder, without fsync) and kube-apiserver on free ports, TLS from a throwaway
  CA (trustme), bearer tokens from a token file (``admin`` is in ``system:masters``), RBAC authorization, service
  account tokens signed by a fresh key (so ``TokenRequest`` works as in a cluster);
* starts the controller manager (Deployments, ReplicaSets, garbage collection, namespaces, service accounts, node
  lifecycle) and the scheduler, as a cluster runs them, so a scale sees what it sees in production: ``409`` on a
  stale write, ``status.replicas`` behind ``spec.replicas``, pods with a ``deletionTimestamp`` before they go;
* starts kwok with ``scripts/kube/kwok-stages.yaml`` and creates ``nodes`` fake nodes it manages: pods scheduled on
  them become Running and Ready without containers; a pod being deleted goes at once, as if its process exited on
  SIGTERM, unless it is labelled ``fleet.test/terminate=process`` (``tests/kube_kubelet.py`` runs a process for
  it): then it stays Terminating until its grace period ends or something deletes it sooner, as a kubelet does
  once the containers exit.

Start-up takes about 5 seconds. ``FLEET_TEST_KUBE_SERVER`` + ``FLEET_TEST_KUBE_TOKEN`` (+ ``FLEET_TEST_KUBE_CA``)
point the tests at a running control plane instead (it must have kwok nodes labelled ``type=kwok``).
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trustme
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from kubernetes import client

from fleet.errors import ServiceUnavailable
from tests.services import die_with_parent, free_port, stop_server, wait_port

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "scripts" / "kube" / "build.sh"
KWOK_STAGES = ROOT / "scripts" / "kube" / "kwok-stages.yaml"
BUILD_TIMEOUT_S = 2400
KWOK_NODE_LABEL = {"type": "kwok"}
# The controllers a cluster needs for Deployments to run pods (and namespaces and service accounts to work).
CONTROLLERS = ",".join(
    (
        "deployment-controller",
        "replicaset-controller",
        "garbage-collector-controller",
        "namespace-controller",
        "serviceaccount-controller",
        "serviceaccount-token-controller",
        "root-ca-certificate-publisher-controller",
        "node-lifecycle-controller",
        "endpointslice-controller",
        "taint-eviction-controller",
    )
)


@dataclass
class KubeCluster:
    server: str  # https://127.0.0.1:PORT
    token: str  # a bearer token in system:masters
    ca_file: str  # the CA that signed the API server's certificate
    nodes: list[str] = field(default_factory=list)  # the kwok nodes' names
    workdir: Path | None = None

    def configuration(self, token: str | None = None) -> client.Configuration:
        configuration = client.Configuration()
        configuration.host = self.server
        configuration.ssl_ca_cert = self.ca_file
        configuration.api_key = {"authorization": token or self.token}
        configuration.api_key_prefix = {"authorization": "Bearer"}
        return configuration

    def api_client(self, token: str | None = None) -> client.ApiClient:
        """An ApiClient of the official client; the admin's unless ``token`` is given. Close it after use."""
        return client.ApiClient(self.configuration(token))

    def _authority(self) -> dict[str, str]:
        """The CA inline (``certificate-authority-data``): the kubeconfig works wherever it is copied or mounted."""
        if not self.ca_file:
            return {}
        return {"certificate-authority-data": base64.b64encode(Path(self.ca_file).read_bytes()).decode()}

    def kubeconfig(self, path: Path, token: str | None = None, namespace: str = "default") -> Path:
        """Write a kubeconfig for ``token`` (the admin's by default) to ``path``: what kubectl, helm and the
        kubernetes backend's ``kubeconfig`` option read."""
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fleet-test", "cluster": {"server": self.server, **self._authority()}}],
            "users": [{"name": "user", "user": {"token": token or self.token}}],
            "contexts": [
                {"name": "fleet-test", "context": {"cluster": "fleet-test", "user": "user", "namespace": namespace}}
            ],
            "current-context": "fleet-test",
        }
        path.write_text(yaml.safe_dump(doc))
        return path


def kube_binaries() -> Path:
    """The folder with the cached control-plane binaries (built now if the cache is empty: about 11 minutes)."""
    try:
        proc = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise ServiceUnavailable(
            "kubernetes control plane", f"{BUILD} did not finish within {BUILD_TIMEOUT_S}s"
        ) from exc
    folder = Path(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else Path()
    if proc.returncode != 0 or not (folder / "kube-apiserver").is_file():
        raise ServiceUnavailable("kubernetes control plane", f"{BUILD} failed:\n{proc.stderr[-2000:]}")
    return folder


def _service_account_key(tmp: Path) -> tuple[Path, Path]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private, public = tmp / "sa.key", tmp / "sa.pub"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return private, public


class _Processes:
    """The started components, stopped in reverse order by PID; each logs to ``<name>.log`` in the run folder."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with (self.tmp / f"{name}.log").open("wb") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, cwd=self.tmp, preexec_fn=die_with_parent
            )
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> Path:
        return self.tmp / f"{name}.log"

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = self.log(name).read_text(errors="replace")[-3000:]
                raise ServiceUnavailable(name, f"exited with {proc.returncode}:\n{tail}")

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            stop_server(proc)


def _wait(what: str, probe: Any, processes: _Processes, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        processes.check_alive()
        try:
            if probe():
                return
        except Exception as exc:
            last = exc
        time.sleep(0.1)
    raise ServiceUnavailable("kubernetes control plane", f"{what} not ready within {timeout_s}s (last: {last})")


def _kwok_node(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {**KWOK_NODE_LABEL, "kubernetes.io/hostname": name, "kubernetes.io/os": "linux"},
        },
        "spec": {},
        "status": {
            "allocatable": {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "8"},
            "capacity": {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "8"},
        },
    }


@contextlib.contextmanager
def kube_cluster(nodes: int = 3, timeout_s: float = 60) -> Iterator[KubeCluster]:
    server, token = os.environ.get("FLEET_TEST_KUBE_SERVER"), os.environ.get("FLEET_TEST_KUBE_TOKEN")
    if server and token:
        cluster = KubeCluster(server, token, os.environ.get("FLEET_TEST_KUBE_CA", ""))
        with cluster.api_client() as api:
            found = client.CoreV1Api(api).list_node(label_selector="type=kwok").items
        cluster.nodes = [n.metadata.name for n in found]
        yield cluster
        return
    binaries = kube_binaries()
    tmp = Path(tempfile.mkdtemp(prefix="fleet-kube-"))
    processes = _Processes(tmp)
    try:
        yield _start(binaries, tmp, processes, nodes, timeout_s)
    finally:
        processes.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _start(binaries: Path, tmp: Path, processes: _Processes, nodes: int, timeout_s: float) -> KubeCluster:
    etcd_port, etcd_peer, api_port = free_port(), free_port(), free_port()
    processes.start(
        "etcd",
        [
            str(binaries / "etcd"),
            "--data-dir", str(tmp / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-cluster", f"default=http://127.0.0.1:{etcd_peer}",
            "--unsafe-no-fsync",
            "--log-level", "warn",
        ],
    )  # fmt: skip
    wait_port("127.0.0.1", etcd_port, processes.procs["etcd"], processes.log("etcd"), timeout_s, "etcd")

    ca = trustme.CA()
    serving = ca.issue_cert("127.0.0.1", "localhost", "kubernetes.default.svc")
    ca_file, cert_file, key_file = tmp / "ca.crt", tmp / "apiserver.crt", tmp / "apiserver.key"
    ca.cert_pem.write_to_path(str(ca_file))
    serving.cert_chain_pems[0].write_to_path(str(cert_file))
    serving.private_key_pem.write_to_path(str(key_file))
    sa_key, sa_pub = _service_account_key(tmp)
    admin_token = os.urandom(16).hex()
    (tmp / "tokens.csv").write_text(f'{admin_token},admin,admin-uid,"system:masters"\n')
    processes.start(
        "kube-apiserver",
        [
            str(binaries / "kube-apiserver"),
            "--etcd-servers", f"http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={api_port}",
            "--endpoint-reconciler-type=none",
            "--tls-cert-file", str(cert_file), "--tls-private-key-file", str(key_file),
            "--client-ca-file", str(ca_file),
            "--token-auth-file", str(tmp / "tokens.csv"),
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--service-account-key-file", str(sa_pub),
            "--service-account-signing-key-file", str(sa_key),
            "--service-cluster-ip-range=10.96.0.0/16",
            "--profiling=false",
        ],
    )  # fmt: skip
    cluster = KubeCluster(f"https://127.0.0.1:{api_port}", admin_token, str(ca_file), workdir=tmp)
    configuration = cluster.configuration()
    configuration.retries = 0  # _wait polls; urllib3's retries would only log each refusal
    api = client.ApiClient(configuration)
    try:
        _wait("kube-apiserver /readyz", lambda: _get(api, "/readyz") == "ok", processes, timeout_s)
        kubeconfig = cluster.kubeconfig(tmp / "admin.kubeconfig")
        (tmp / "flex").mkdir()
        processes.start(
            "kube-controller-manager",
            [
                str(binaries / "kube-controller-manager"),
                "--kubeconfig", str(kubeconfig),
                "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
                "--leader-elect=false",
                f"--controllers={CONTROLLERS}",
                "--service-account-private-key-file", str(sa_key),
                "--root-ca-file", str(ca_file),
                "--flex-volume-plugin-dir", str(tmp / "flex"),
                "--node-monitor-grace-period=40s",
                "--concurrent-deployment-syncs=5", "--concurrent-replicaset-syncs=5",
            ],
        )  # fmt: skip
        processes.start(
            "kube-scheduler",
            [
                str(binaries / "kube-scheduler"),
                "--kubeconfig", str(kubeconfig),
                "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
                "--leader-elect=false",
            ],
        )  # fmt: skip
        processes.start(
            "kwok",
            [
                str(binaries / "kwok"),
                "--kubeconfig", str(kubeconfig),
                "--config", str(KWOK_STAGES),
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                "--node-ip=127.0.0.1",
                "--cidr=10.244.0.0/16",
            ],
        )  # fmt: skip
        core = client.CoreV1Api(api)
        for i in range(nodes):
            name = f"kwok-node-{i}"
            core.create_node(_kwok_node(name))
            cluster.nodes.append(name)
        _wait("the kwok nodes", lambda: all(_node_ready(core, n) for n in cluster.nodes), processes, timeout_s)
        _wait(
            "the default service account",
            lambda: bool(core.list_namespaced_service_account("default").items),
            processes,
            timeout_s,
        )
    except BaseException:
        api.close()
        raise
    api.close()
    return cluster


def _get(api: client.ApiClient, path: str) -> str:
    response = api.call_api(*api.param_serialize("GET", path, auth_settings=["BearerToken"]))
    response.read()
    return str(response.data.decode())


def _node_ready(core: client.CoreV1Api, name: str) -> bool:
    node = core.read_node(name)
    conditions = node.status.conditions or [] if node.status is not None else []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


# -- applying manifests -------------------------------------------------------------------------------------------


def dynamic(api: client.ApiClient) -> Any:
    """A ``kubernetes.dynamic.DynamicClient`` (it reads the API server's discovery documents: about a second)."""
    from kubernetes.dynamic import DynamicClient

    return DynamicClient(api)


def apply(dyn: Any, doc: dict[str, Any], namespace: str, *, manager: str = "fleet-tests") -> dict[str, Any]:
    """Server-side apply of one manifest with strict field validation, as ``kubectl apply --server-side
    --validate=strict`` does: an unknown or duplicate field, a wrong type or a value the API server refuses is an
    ``ApiException`` (400 or 422) naming it. Returns the object as stored."""
    resource = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
    applied = dyn.server_side_apply(
        resource,
        body=doc,
        namespace=namespace if resource.namespaced else None,
        field_manager=manager,
        force_conflicts=True,
        query_params=[("fieldValidation", "Strict")],
    )
    stored: dict[str, Any] = applied.to_dict()
    return stored


def create_namespace(api: client.ApiClient, name: str) -> None:
    client.CoreV1Api(api).create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})


def service_account_token(api: client.ApiClient, namespace: str, account: str, seconds: int = 3600) -> str:
    """A bound token for ``account`` from the TokenRequest API: what the kubelet mounts into a pod."""
    request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": seconds}}
    response = client.CoreV1Api(api).create_namespaced_service_account_token(account, namespace, request)
    return str(response.status.token)


def main() -> None:
    """``python -m tests.kube_service``: start the control plane, print a kubeconfig for it, run until Ctrl-C."""
    import signal as signals

    with kube_cluster() as cluster:
        assert cluster.workdir is not None
        path = cluster.kubeconfig(cluster.workdir / "admin.kubeconfig")
        print(f"control plane up: {cluster.server}, kwok nodes {', '.join(cluster.nodes)}")
        print(f"export KUBECONFIG={path}   (Ctrl-C stops etcd, the API server, the controllers and kwok)")
        with contextlib.suppress(KeyboardInterrupt):
            signals.pause()


if __name__ == "__main__":
    main()
