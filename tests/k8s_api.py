"""An in-test Kubernetes API server for the apps/v1 Deployment ``scale`` subresource, faithful to kube-apiserver.

A real kube-apiserver needs etcd and cannot be obtained on this machine in reasonable time, so the kubernetes
backend's tests drive this server through the official client instead. What it reproduces, as the real server does:

* ``GET`` and ``PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale`` answer an ``autoscaling/v1 Scale``
  (``metadata`` name, namespace, uid, resourceVersion, creationTimestamp; ``spec.replicas``; ``status.replicas``
  and ``status.selector``);
* PATCH bodies as ``application/merge-patch+json``, ``application/strategic-merge-patch+json`` (the client's
  choice for an object body) and ``application/json-patch+json``; another content type is ``415``;
* ``resourceVersion`` comes from one counter for the whole server (as etcd's revision does), increments on every
  change and stays put on a patch that changes nothing; a patch naming a stale ``metadata.resourceVersion`` is a
  ``409 Conflict``;
* errors are ``v1 Status`` objects: ``404 NotFound`` for an unknown Deployment, ``422 Invalid`` for negative or
  non-integer replicas, ``400 BadRequest`` for a body that is not JSON;
* bearer tokens with RBAC-like grants: no or an unknown token is ``401 Unauthorized``, a token without the verb on
  ``deployments/scale`` (or any other resource: the least-privilege Role grants nothing else) is ``403 Forbidden``
  with the message kube-apiserver writes.

Every request is recorded (method, path, content type) so tests can check what a client touched.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SCALE_PATH = re.compile(r"^/apis/apps/v1/namespaces/(?P<ns>[^/]+)/deployments/(?P<name>[^/]+)/scale$")
PATCH_TYPES = (
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
    "application/json-patch+json",
)
CREATED = "2025-01-01T00:00:00Z"


class ApiError(Exception):
    def __init__(self, status: dict[str, Any]) -> None:
        super().__init__(status["message"])
        self.status = status


def status_object(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``v1 Status`` as kube-apiserver writes it for a failed request."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details is not None:
        body["details"] = details
    return body


@dataclass(slots=True)
class Deployment:
    namespace: str
    name: str
    replicas: int
    resource_version: int
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    selector: str = ""

    def scale(self) -> dict[str, Any]:
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "uid": self.uid,
                "resourceVersion": str(self.resource_version),
                "creationTimestamp": CREATED,
            },
            "spec": {"replicas": self.replicas},
            "status": {"replicas": self.replicas, "selector": self.selector},
        }


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    content_type: str | None
    body: str


class FakeKubeApi:
    """The cluster state and the rules; ``serve()`` puts it behind HTTP on a free port."""

    def __init__(self) -> None:
        self.deployments: dict[tuple[str, str], Deployment] = {}
        self.tokens: dict[str, tuple[str, set[str]]] = {}  # token -> (user, verbs on deployments/scale)
        self.requests: list[Request] = []
        self._revision = itertools.count(1000)
        self._lock = threading.Lock()

    # -- set-up ------------------------------------------------------------------------------------------------
    def add_deployment(self, namespace: str, name: str, replicas: int = 1) -> Deployment:
        with self._lock:
            deployment = Deployment(
                namespace, name, replicas, next(self._revision), selector=f"app.kubernetes.io/name={name}"
            )
            self.deployments[(namespace, name)] = deployment
            return deployment

    def grant(self, token: str, verbs: set[str], user: str = "system:serviceaccount:fleet:autoscaler") -> None:
        self.tokens[token] = (user, set(verbs))

    def replicas(self, namespace: str, name: str) -> int:
        return self.deployments[(namespace, name)].replicas

    # -- the API -----------------------------------------------------------------------------------------------
    def handle(self, method: str, path: str, token: str | None, content_type: str | None, raw: bytes) -> dict:
        """Answer one request: the response body (a Scale), or raise ``ApiError`` with a Status."""
        with self._lock:
            self.requests.append(Request(method, path, content_type, raw.decode(errors="replace")))
            user, verbs = self._authenticate(token)
            match = SCALE_PATH.match(path)
            verb = {"GET": "get", "PATCH": "patch", "PUT": "update"}.get(method, method.lower())
            if match is None:
                raise ApiError(_forbidden(user, verb, path))
            namespace, name = match["ns"], match["name"]
            if verb not in verbs:
                raise ApiError(_forbidden(user, verb, path, namespace, name))
            deployment = self.deployments.get((namespace, name))
            if deployment is None:
                raise ApiError(
                    status_object(
                        404,
                        "NotFound",
                        f'deployments.apps "{name}" not found',
                        {"name": name, "group": "apps", "kind": "deployments"},
                    )
                )
            if verb == "get":
                return deployment.scale()
            if verb == "patch":
                return self._patch(deployment, content_type, _parse(raw))
            raise ApiError(status_object(405, "MethodNotAllowed", f"the server does not allow this method: {method}"))

    def _authenticate(self, token: str | None) -> tuple[str, set[str]]:
        if token is None or token not in self.tokens:
            raise ApiError(status_object(401, "Unauthorized", "Unauthorized"))
        return self.tokens[token]

    def _patch(self, deployment: Deployment, content_type: str | None, patch: Any) -> dict[str, Any]:
        media = (content_type or "").split(";")[0].strip()
        if media not in PATCH_TYPES:
            raise ApiError(
                status_object(
                    415, "UnsupportedMediaType", f"the body of the request was in an unknown format - {media}"
                )
            )
        current = deployment.scale()
        if media == "application/json-patch+json":
            patched = _json_patch(current, patch)
        else:
            if not isinstance(patch, dict):
                raise ApiError(status_object(400, "BadRequest", "the body of the request must be a JSON object"))
            patched = _merge_patch(current, patch)
        wanted_version = (patch.get("metadata") or {}).get("resourceVersion") if isinstance(patch, dict) else None
        if wanted_version is not None and wanted_version != current["metadata"]["resourceVersion"]:
            raise ApiError(
                status_object(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on deployments.apps "{deployment.name}": the object has been '
                    "modified; please apply your changes to the latest version and try again",
                    {"name": deployment.name, "group": "apps", "kind": "deployments"},
                )
            )
        replicas = _validate_replicas(deployment.name, (patched.get("spec") or {}).get("replicas"))
        if replicas != deployment.replicas:
            deployment.replicas = replicas
            deployment.resource_version = next(self._revision)
        return deployment.scale()


def _parse(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ApiError(status_object(400, "BadRequest", f"error decoding patch: {exc}")) from exc


def _forbidden(
    user: str, verb: str, path: str, namespace: str | None = None, name: str | None = None
) -> dict[str, Any]:
    if name is None:
        return status_object(403, "Forbidden", f'forbidden: User "{user}" cannot {verb} path "{path}"', {})
    return status_object(
        403,
        "Forbidden",
        f'deployments.apps "{name}" is forbidden: User "{user}" cannot {verb} resource "deployments/scale" '
        f'in API group "apps" in the namespace "{namespace}"',
        {"name": name, "group": "apps", "kind": "deployments"},
    )


def _validate_replicas(name: str, replicas: Any) -> int:
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        detail = f"spec.replicas: Invalid value: {json.dumps(replicas)}: must be an integer"
    elif replicas < 0:
        detail = f"spec.replicas: Invalid value: {replicas}: must be greater than or equal to 0"
    else:
        return replicas
    raise ApiError(
        status_object(
            422,
            "Invalid",
            f'Scale.autoscaling "{name}" is invalid: {detail}',
            {
                "name": name,
                "group": "autoscaling",
                "kind": "Scale",
                "causes": [
                    {"reason": "FieldValueInvalid", "message": detail.split(": ", 1)[1], "field": "spec.replicas"}
                ],
            },
        )
    )


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (also what a strategic merge patch does to a Scale, which has no lists)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


def _json_patch(target: dict[str, Any], operations: Any) -> dict[str, Any]:
    """RFC 6902 JSON patch: add, replace, remove and test on object members."""
    if not isinstance(operations, list):
        raise ApiError(status_object(400, "BadRequest", "a JSON patch must be a list of operations"))
    result = copy.deepcopy(target)
    for op in operations:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in str(op.get("path", "")).split("/")[1:]]
        node: Any = result
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            raise ApiError(status_object(422, "Invalid", f"jsonpatch: path {op.get('path')!r} does not exist"))
        kind = op.get("op")
        if kind in ("add", "replace"):
            node[last] = op.get("value")
        elif kind == "remove":
            node.pop(last, None)
        elif kind == "test" and node.get(last) != op.get("value"):
            raise ApiError(status_object(422, "Invalid", f"jsonpatch: test failed at {op.get('path')!r}"))
    return result


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        self._answer()

    def do_PATCH(self) -> None:
        self._answer()

    def do_PUT(self) -> None:
        self._answer()

    def _answer(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        auth = self.headers.get("Authorization") or ""
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else None
        path = self.path.split("?", 1)[0]
        try:
            body = self.server.api.handle(self.command, path, token, self.headers.get("Content-Type"), raw)
            code = 200
        except ApiError as exc:
            body, code = exc.status, exc.status["code"]
        data = json.dumps(body).encode()
        self.send_response(code, HTTPStatus(code).phrase)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the request log is FakeKubeApi.requests


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    api: FakeKubeApi


@contextmanager
def serve(api: FakeKubeApi) -> Iterator[str]:
    """Serve ``api`` on a free local port; yields its base URL."""
    server = _Server(("127.0.0.1", 0), _Handler)
    server.api = api
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="fake-kube-api", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
