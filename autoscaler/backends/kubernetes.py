"""``kubernetes``: set the replicas of each model's worker Deployment through its ``scale`` subresource.

Only ``get`` and ``patch`` on ``deployments/scale`` (apps/v1) are used, which is all the autoscaler's
least-privilege Role grants. Scale-in is graceful because Kubernetes sends SIGTERM to the pods it removes and the
chart's termination grace period is longer than the worker's drain deadline. The official client is synchronous,
so each call runs in a thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import urllib3
from kubernetes import client, config

from fleet.autoscaler.backends.base import check_replicas
from fleet.errors import ConfigError, ScalerError

log = logging.getLogger(__name__)

DEFAULT_DEPLOYMENT_TEMPLATE = "fleet-worker-{model}"
DEFAULT_REQUEST_TIMEOUT_S = 10.0


def load_api_client(kubeconfig: str | None = None, context: str | None = None) -> client.ApiClient:
    """An ApiClient from the in-cluster service account, else from a kubeconfig file (``~/.kube/config``).

    Raises:
        ConfigError: neither is available or the kubeconfig is invalid.
    """
    configuration = client.Configuration()
    if kubeconfig is None and context is None:
        try:
            config.load_incluster_config(client_configuration=configuration)
            return client.ApiClient(configuration)
        except config.ConfigException:
            log.debug("kubernetes: not in a cluster; trying a kubeconfig file")
    try:
        config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)
    except (config.ConfigException, OSError) as exc:
        raise ConfigError(
            "the kubernetes backend found no cluster credentials: run it in a pod with a service account, or point "
            f"KUBECONFIG (or the kubeconfig option) at a kubeconfig file ({exc})"
        ) from exc
    return client.ApiClient(configuration)


class KubernetesBackend:
    """Scales the Deployment ``deployment_name_template.format(model=...)`` in ``namespace``.

    Args:
        namespace: the namespace of the worker Deployments.
        deployment_name_template: the Deployment of a model; ``{model}`` is the model name with ``_`` turned into
            ``-`` (Kubernetes names allow no underscores).
        api_client: a configured ``kubernetes.client.ApiClient``; by default one is loaded from the in-cluster
            service account, else from ``kubeconfig`` / ``context`` (default ``~/.kube/config``).
        request_timeout_s: limit of each API call.

    Raises (from the calls):
        ScalerError: the Deployment does not exist or the service account may not read or patch its scale
            (``retriable`` False), or the API server failed or could not be reached (``retriable`` True).
    """

    name = "kubernetes"

    def __init__(
        self,
        namespace: str,
        deployment_name_template: str = DEFAULT_DEPLOYMENT_TEMPLATE,
        api_client: client.ApiClient | None = None,
        *,
        kubeconfig: str | None = None,
        context: str | None = None,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    ) -> None:
        if "{model}" not in deployment_name_template:
            raise ConfigError(
                f"deployment name template {deployment_name_template!r} must contain '{{model}}', "
                "e.g. 'fleet-worker-{model}'"
            )
        self.namespace = namespace
        self.template = deployment_name_template
        self._owns_client = api_client is None
        self._api_client = api_client if api_client is not None else load_api_client(kubeconfig, context)
        self._apps = client.AppsV1Api(self._api_client)
        self._timeout_s = request_timeout_s
        self._closed = False

    def deployment_name(self, model: str) -> str:
        return self.template.format(model=model.replace("_", "-"))

    async def current_replicas(self, model: str) -> int:
        """The Deployment's ``spec.replicas`` (pods starting count too, as for the HorizontalPodAutoscaler)."""
        scale = await self._call("get", model, self._apps.read_namespaced_deployment_scale)
        return int(scale.spec.replicas or 0) if scale.spec is not None else 0

    async def set_replicas(self, model: str, replicas: int) -> None:
        check_replicas(model, replicas)
        body = {"spec": {"replicas": replicas}}
        scale = await self._call("patch", model, self._apps.patch_namespaced_deployment_scale, body=body)
        log.info(
            "kubernetes: %s/%s scaled to %d (resourceVersion %s)",
            self.namespace,
            self.deployment_name(model),
            replicas,
            scale.metadata.resource_version if scale.metadata is not None else "?",
        )

    async def close(self) -> None:
        """Close the ApiClient if this backend created it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._owns_client:
            await asyncio.to_thread(self._api_client.close)

    async def _call(self, verb: str, model: str, method: Any, **kwargs: Any) -> Any:
        name = self.deployment_name(model)
        try:
            return await asyncio.to_thread(method, name, self.namespace, _request_timeout=self._timeout_s, **kwargs)
        except client.ApiException as exc:
            raise self._api_error(verb, model, name, exc) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ScalerError(
                f"kubernetes API server unreachable while trying to {verb} the scale of deployment "
                f"{self.namespace}/{name}: {exc}",
                backend=self.name,
                target=f"{self.namespace}/{name}",
            ) from exc

    def _api_error(self, verb: str, model: str, name: str, exc: client.ApiException) -> ScalerError:
        target = f"{self.namespace}/{name}"
        if exc.status == 404:
            message = (
                f"deployment {target} not found (model {model!r}): deploy the worker Deployment for this model, "
                f"or set the namespace and deployment name template (now {self.template!r})"
            )
        elif exc.status in (401, 403):
            message = (
                f"not allowed to {verb} the scale of deployment {target} ({exc.status} {exc.reason}): grant the "
                "autoscaler's service account get and patch on deployments/scale in this namespace"
            )
        else:
            return ScalerError(
                f"could not {verb} the scale of deployment {target}: {exc.status} {exc.reason}: {_status_message(exc)}",
                backend=self.name,
                target=target,
                retriable=exc.status is None or exc.status >= 500 or exc.status in (409, 429),
            )
        return ScalerError(message, backend=self.name, target=target, retriable=False)


def _status_message(exc: client.ApiException) -> str:
    """The ``message`` of the Status object the API server sent, else the raw body."""
    try:
        return str(json.loads(exc.body or "")["message"])
    except (ValueError, KeyError, TypeError):
        return str(exc.body or "").strip()[:300]
