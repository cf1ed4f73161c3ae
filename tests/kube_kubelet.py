"""A kubelet for kwok's fake nodes that runs pods as local processes: how the deploy tests run the chart's
workers and autoscaler on the real control plane (``tests/kube_service.py``) without containers.

``ProcessKubelet`` watches the pods that match a label selector in one namespace and does, for each, what a kubelet
does with its container:

* a pod that kwok reports Running gets a process: the container's ``command`` and ``args`` with ``$(VAR)``
  expanded from the container's ``env`` (values and ``fieldRef`` to the pod's name and namespace) and ``envFrom``
  ConfigMaps and Secrets, read from the API server; ``fleet`` is this interpreter's ``-m fleet.cli``;
* a pod with ``automountServiceAccountToken`` gets its service account's token from the TokenRequest API, handed
  over as a kubeconfig (``KUBECONFIG``) instead of the files under ``/var/run/secrets`` (the one stand-in: those
  paths are fixed and global on this machine);
* a pod being deleted (``deletionTimestamp`` set) gets SIGTERM, once; when the process exits, the pod is deleted
  with grace period 0, as the kubelet does once the containers are gone. The pod carries the label
  ``fleet.test/terminate=process`` from its start, so kwok leaves it Terminating meanwhile and deletes it only
  when the grace period ends (``scripts/kube/kwok-stages.yaml``), as Kubernetes would after SIGKILL; a process
  still running then is killed and recorded in ``killed``;
* a pod's container ports are its own in Kubernetes, but the processes here share one network: an argument equal
  to a declared ``containerPort`` becomes a free port.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client

from tests.kube_service import KubeCluster, service_account_token
from tests.services import die_with_parent, free_port

ROOT = Path(__file__).resolve().parents[1]
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


class ProcessKubelet:
    """Runs the pods matching ``selector`` in ``namespace`` as processes (see the module docstring).

    ``async with`` starts and stops the loop; leaving it sends SIGTERM to every process left and waits for them.
    """

    def __init__(
        self,
        cluster: KubeCluster,
        namespace: str,
        selector: str,
        log_dir: Path,
        *,
        env: dict[str, str] | None = None,
        poll_s: float = 0.1,
    ) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.selector = selector
        self.log_dir = log_dir
        self.env = {"PATH": os.environ.get("PATH", ""), "HOME": str(log_dir), "PYTHONPATH": str(ROOT), **(env or {})}
        self.poll_s = poll_s
        self.processes: dict[str, PodProcess] = {}
        self.killed: list[str] = []  # pods that went while their process still ran
        self.terminating_seen: set[str] = set()
        self._api = cluster.api_client()
        self._core = client.CoreV1Api(self._api)
        self._task: asyncio.Task[None] | None = None
        self.errors: list[str] = []

    async def __aenter__(self) -> ProcessKubelet:
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
                self.terminating_seen.add(name)
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
                if name in present:
                    self._delete_now(name)
            elif code is None and name not in present:
                known.process.kill()
                self.killed.append(name)

    def _delete_now(self, name: str) -> None:
        with contextlib.suppress(client.ApiException):
            self._core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)

    def _start(self, pod: client.V1Pod) -> PodProcess:
        (container,) = pod.spec.containers
        # from now on the process decides when the pod ends (scripts/kube/kwok-stages.yaml)
        self._core.patch_namespaced_pod(pod.metadata.name, self.namespace, {"metadata": {"labels": TERMINATE_LABEL}})
        env = self._container_env(pod, container)
        if pod.spec.automount_service_account_token and pod.spec.service_account_name:
            token = service_account_token(self._api, self.namespace, pod.spec.service_account_name)
            kubeconfig = self.log_dir / f"{pod.metadata.name}.kubeconfig"
            env["KUBECONFIG"] = str(self.cluster.kubeconfig(kubeconfig, token, self.namespace))
        ports = {str(p.container_port): str(free_port()) for p in container.ports or []}
        argv = [
            ports.get(a, a) for a in (_expand(a, env) for a in [*(container.command or []), *(container.args or [])])
        ]
        if argv and argv[0] == "fleet":
            argv = [sys.executable, "-m", "fleet.cli", *argv[1:]]
        log = self.log_dir / f"{pod.metadata.name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**self.env, **env},
                cwd=self.log_dir,
                preexec_fn=die_with_parent,
            )
        return PodProcess(pod.metadata.name, pod.spec.node_name, process, log, time.monotonic())

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


def _expand(text: str, env: dict[str, Any]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a known variable is replaced, an unknown one is left as written."""
    return VAR.sub(lambda m: str(env.get(m.group(1), m.group(0))), text)
