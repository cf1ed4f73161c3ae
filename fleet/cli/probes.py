"""The worker's own HTTP port (``fleet worker --metrics-port``): ``/metrics``, ``/healthz`` and ``/readyz``.

* ``/healthz``: 200 while the process runs (a liveness probe: restart only a process that no longer answers).
* ``/readyz``: 200 only once the model is loaded, warmed up and taking work (the worker's state is ``ready``);
  503 with the state otherwise (``starting`` while it connects and loads, ``draining`` after SIGTERM, ``stopped``,
  or any other state a worker reports). The body names the model, the worker id, the state and the versions
  loaded. A multi-model worker process (``PoolProbe``) is ready when each of its workers is: they load their
  models on demand, so ready says "taking work", and ``loaded`` says which versions are warm.
* everything else: Prometheus metrics.

It runs in a daemon thread (like ``prometheus_client.start_http_server``), so it answers while the event loop
is busy starting, and it reads the worker's state without locking: a string attribute read is atomic.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from fleet.errors import ConfigError

READY = "ready"
StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class _Worker(Protocol):
    worker_id: str
    state: str

    def loaded(self) -> list[str]: ...


class Probe(Protocol):
    def status(self) -> tuple[int, dict[str, Any]]: ...


class WorkerProbe:
    """The state ``/readyz`` reports: ``starting`` until ``track`` hands it the worker, then that worker's."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.worker: _Worker | None = None

    def track(self, worker: Any) -> Any:
        """Follow ``worker`` (each start-up attempt builds a new one); returns it, for use inside a builder."""
        self.worker = worker
        return worker

    def status(self) -> tuple[int, dict[str, Any]]:
        worker = self.worker
        state = worker.state if worker is not None else "starting"
        worker_id = worker.worker_id if worker is not None else None
        loaded = worker.loaded() if worker is not None else []
        details = {"model": self.model, "worker_id": worker_id, "state": state, "loaded": loaded}
        if state == READY:
            return 200, {"status": READY, **details}
        message = f"worker {worker_id or '(not built yet)'} of model {self.model!r} is {state}, not ready"
        return 503, {"error": {"type": "not_ready", "message": message, "details": details}}


class PoolProbe:
    """The readiness of a multi-model worker process: ready when every one of its workers is (a worker of a pool is
    ready once subscribed, before its models load); the body lists each model's state and loaded versions."""

    def __init__(self, models: list[str]) -> None:
        self.probes = {model: WorkerProbe(model) for model in models}

    def status(self) -> tuple[int, dict[str, Any]]:
        statuses = {model: probe.status() for model, probe in self.probes.items()}
        models = {
            model: body.get("error", {}).get("details") or {k: v for k, v in body.items() if k != "status"}
            for model, (_, body) in statuses.items()
        }
        waiting = [model for model, (code, _) in statuses.items() if code != 200]
        if not waiting:
            return 200, {"status": READY, "models": models}
        message = f"models {', '.join(waiting)} of this worker process are not ready"
        return 503, {"error": {"type": "not_ready", "message": message, "details": {"models": models}}}


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Probes come every few seconds: no access log."""


def probe_app(probe: Probe) -> Callable[[dict[str, Any], StartResponse], Iterable[bytes]]:
    metrics = make_wsgi_app()

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            return _json(start_response, 200, {"status": "ok"})
        if path == "/readyz":
            return _json(start_response, *probe.status())
        return metrics(environ, start_response)  # type: ignore[no-any-return]

    return app


def _json(start_response: StartResponse, code: int, body: dict[str, Any]) -> list[bytes]:
    data = json.dumps(body).encode()
    reason = "OK" if code == 200 else "Service Unavailable"
    start_response(f"{code} {reason}", [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
    return [data]


def serve_probes(probe: Probe, port: int, host: str = "0.0.0.0") -> ThreadingWSGIServer:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz`` on ``host:port`` in a daemon thread.

    Raises:
        ConfigError: the port cannot be bound (in use, or not allowed).
    """
    try:
        server = make_server(host, port, probe_app(probe), ThreadingWSGIServer, handler_class=_QuietHandler)
    except OSError as exc:
        raise ConfigError(
            f"cannot serve metrics and probes on {host}:{port}: {exc.strerror or exc}; another process may be "
            "serving there: stop it, or pick another --metrics-port"
        ) from exc
    threading.Thread(target=server.serve_forever, name="worker-probes", daemon=True).start()
    return server
