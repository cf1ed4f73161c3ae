"""A kubelet for kwok's fake nodes that runs each pod's container from its image with podman: how the deploy tests
run the chart's workers and autoscaler, in Fleet's own image, on the real control plane (``tests/kube_service.py``).

``ContainerKubelet`` watches the pods that match a label selector in one namespace and does, for each, what a
kubelet does with its container:

* a pod that kwok reports Running gets a container: ``podman run`` of the container's ``image`` (the chart's
  default is the one ``make image`` builds) with its ``command`` (the image's entry point is ``fleet``) and
  ``args``, ``$(VAR)`` expanded from the container's ``env`` (values and ``fieldRef`` to the pod's name and
  namespace) and ``envFrom`` ConfigMaps and Secrets read from the API server; ``tests/kube_handlers.py`` is mounted
  at ``/opt/plugins`` (on ``PYTHONPATH``) for the test's models;
* a pod with ``automountServiceAccountToken`` gets its service account's token from the TokenRequest API, mounted
  as a kubeconfig (``KUBECONFIG``) instead of the files under ``/var/run/secrets`` (the one stand-in: the
  in-cluster address is a Service IP that nothing routes here);
* a pod being deleted (``deletionTimestamp`` set) gets SIGTERM, once (podman passes it on to the container's
  process); when the container exits, the pod is deleted with grace period 0, as the kubelet does once the
  containers are gone. The pod carries the label ``fleet.test/terminate=process`` from its start, so kwok leaves it
  Terminating meanwhile and deletes it only when the grace period ends (``scripts/kube/kwok-stages.yaml``), as
  Kubernetes would after SIGKILL; a container still running then is killed and recorded in ``killed``; one that
  exits unasked is recorded in ``crashed`` (a kubelet would restart it);
* a pod's container ports are its own in Kubernetes, but the containers here share the host's network: an argument
  equal to a declared ``containerPort`` becomes a free port.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client

from tests.image_service import podman, podman_env
from tests.kube_service import KubeCluster, service_account_token
from tests.services import die_with_parent, free_port

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "tests" / "kube_handlers.py"  # the pods' models, mounted into each container
IN_CONTAINER = "/opt/plugins"
TERMINATE_LABEL = {"fleet.test/terminate": "process"}  # kwok then leaves the pod's end to its process
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass
class PodProcess:
    pod: str
    node: str
    process: subprocess.Popen[bytes]
    log: Path
    started_at: float
    term_sent_at: float | None = None
    exited_at: float | None = None
    returncode: int | None = None


class ContainerKubelet:
    """Runs the pods matching ``selector`` in ``namespace`` as containers (see the module docstring).

    ``async with`` starts and stops the loop; leaving it sends SIGTERM to every container left, waits for them and
    removes them.
    """

    def __init__(
        self,
        cluster: KubeCluster,
        namespace: str,
        selector: str,
        log_dir: Path,
        *,
        poll_s: float = 0.1,
    ) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.selector = selector
        self.log_dir = log_dir
        self.poll_s = poll_s
        self.processes: dict[str, PodProcess] = {}
        self.killed: list[str] = []  # pods that went while their process still ran
        self.crashed: list[str] = []  # pods whose process exited without being asked to
        self._api = cluster.api_client()
        self._core = client.CoreV1Api(self._api)
        self._task: asyncio.Task[None] | None = None
        self.errors: list[str] = []  # what the loop met (an API call that failed): a test asserts there is none

    async def __aenter__(self) -> ContainerKubelet:
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for running in self.running():
            running.process.terminate()
        for running in self.running():
            try:
                await asyncio.to_thread(running.process.wait, 30)
            except subprocess.TimeoutExpired:
                running.process.kill()
                await asyncio.to_thread(running.process.wait)
        names = [_container_name(p.pod) for p in self.processes.values()]
        if names:
            await asyncio.to_thread(podman, "rm", "--force", "--ignore", *names, check=False, timeout_s=120)
        self._api.close()

    def running(self) -> list[PodProcess]:
        return [p for p in self.processes.values() if p.process.poll() is None]

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.pod} (exit {p.returncode}):\n{p.log.read_text(errors='replace')[-1500:]}"
            for p in self.processes.values()
        )

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self._sync)
            except Exception as exc:
                self.errors.append(repr(exc))
            await asyncio.sleep(self.poll_s)

    def _sync(self) -> None:
        pods = self._core.list_namespaced_pod(self.namespace, label_selector=self.selector).items
        present = {p.metadata.name: p for p in pods}
        for pod in pods:
            name = pod.metadata.name
            known = self.processes.get(name)
            if pod.metadata.deletion_timestamp is not None:
                if known is None:
                    self._delete_now(name)
                elif known.term_sent_at is None and known.process.poll() is None:
                    known.process.send_signal(signal.SIGTERM)
                    known.term_sent_at = time.monotonic()
            elif pod.status.phase == "Running" and known is None:
                self.processes[name] = self._start(pod)
        for name, known in self.processes.items():
            code = known.process.poll()
            if code is not None and known.returncode is None:
                known.returncode, known.exited_at = code, time.monotonic()
                if known.term_sent_at is None:
                    self.crashed.append(name)  # a kubelet would restart it in the same pod: the test fails instead
                elif name in present:
                    self._delete_now(name)
            elif code is None and name not in present and name not in self.killed:
                known.term_sent_at = known.term_sent_at or time.monotonic()  # killed, so not a crash either
                known.process.kill()
                podman("kill", _container_name(name), check=False)
                self.killed.append(name)

    def _delete_now(self, name: str) -> None:
        with contextlib.suppress(client.ApiException):
            self._core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)

    def _start(self, pod: client.V1Pod) -> PodProcess:
        (container,) = pod.spec.containers
        # from now on the process decides when the pod ends (scripts/kube/kwok-stages.yaml)
        self._core.patch_namespaced_pod(pod.metadata.name, self.namespace, {"metadata": {"labels": TERMINATE_LABEL}})
        env = self._container_env(pod, container)
        kubeconfig: Path | None = None
        if pod.spec.automount_service_account_token and pod.spec.service_account_name:
            token = service_account_token(self._api, self.namespace, pod.spec.service_account_name)
            kubeconfig = self.cluster.kubeconfig(
                self.log_dir / f"{pod.metadata.name}.kubeconfig", token, self.namespace
            )
            kubeconfig.chmod(0o644)  # the image's user reads it
        ports = {str(p.container_port): str(free_port()) for p in container.ports or []}
        command = [_expand(a, env) for a in container.command or []]
        args = [ports.get(a, a) for a in (_expand(a, env) for a in container.args or [])]
        argv = self._podman_argv(pod, container, env, command, args, kubeconfig)
        log = self.log_dir / f"{pod.metadata.name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=podman_env(),
                cwd=self.log_dir,
                preexec_fn=die_with_parent,
            )
        return PodProcess(pod.metadata.name, pod.spec.node_name, process, log, time.monotonic())

    def _podman_argv(
        self,
        pod: client.V1Pod,
        container: client.V1Container,
        env: dict[str, str],
        command: list[str],
        args: list[str],
        kubeconfig: Path | None,
    ) -> list[str]:
        """``podman run`` of the container's image in the foreground: podman passes SIGTERM on to the container's
        process and exits with its status, as the process would."""
        flags = ["--rm", "--name", _container_name(pod.metadata.name), "--network", "host"]
        flags += [
            "--health-interval",
            "disable",
            "--stop-timeout",
            str(pod.spec.termination_grace_period_seconds or 30),
        ]
        flags += ["--volume", f"{PLUGINS}:{IN_CONTAINER}/{PLUGINS.name}:ro", "--env", f"PYTHONPATH={IN_CONTAINER}"]
        if kubeconfig is not None:
            flags += [
                "--volume",
                f"{kubeconfig}:/var/run/fleet/kubeconfig:ro",
                "--env",
                "KUBECONFIG=/var/run/fleet/kubeconfig",
            ]
        flags += [f"--env={key}={value}" for key, value in env.items()]
        if command and command != ["fleet"]:  # the image's entry point is fleet
            flags += ["--entrypoint", command[0]]
            args = [*command[1:], *args]
        return ["podman", "run", *flags, container.image, *args]

    def _container_env(self, pod: client.V1Pod, container: client.V1Container) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in container.env_from or []:
            if source.config_map_ref is not None:
                data = self._core.read_namespaced_config_map(source.config_map_ref.name, self.namespace).data or {}
                env.update(data)
            if source.secret_ref is not None:
                secret = self._core.read_namespaced_secret(source.secret_ref.name, self.namespace).data or {}
                env.update({k: base64.b64decode(v).decode() for k, v in secret.items()})
        fields = {"metadata.name": pod.metadata.name, "metadata.namespace": pod.metadata.namespace}
        for var in container.env or []:
            if var.value_from is not None and var.value_from.field_ref is not None:
                env[var.name] = fields[var.value_from.field_ref.field_path]
            elif var.value is not None:
                env[var.name] = _expand(var.value, env)
        return env


def _container_name(pod: str) -> str:
    return f"k8s-{pod}"


def _expand(text: str, env: dict[str, Any]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a known variable is replaced, an unknown one is left as written."""
    return VAR.sub(lambda m: str(env.get(m.group(1), m.group(0))), text)
