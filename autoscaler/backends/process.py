"""``process``: ``fleet worker`` processes on this machine, one per replica.

A model's worker runs ``fleet worker --model REF``; a pool's (``FLEET_POOLS``) runs ``fleet worker --models
REF,REF@V,...`` with the pool's references, one multi-model worker serving them all.

Scale-out starts processes; scale-in sends SIGTERM to the newest ones, which drain (finish the batch in flight,
hand unfinished messages back to the queue) and exit; they are reaped in the background and SIGKILLed only if they
outlive the drain deadline. A process that dies on its own is noticed and no longer counted, so the next decision
replaces it. The workers are this process's children on Linux in one more way: should it die outright (SIGKILL,
an out-of-memory kill), the kernel sends each of them SIGTERM (``PR_SET_PDEATHSIG``), so they drain and exit
rather than serve on with no one to scale them in.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from fleet.autoscaler.backends.base import check_replicas
from fleet.errors import ConfigError, ScalerError
from fleet.models import resolve_spec
from fleet.pools import models_flag
from fleet.repository.layout import Repository
from fleet.settings import FleetSettings

log = logging.getLogger(__name__)

# Settings that belong to the gateway or name the models: a worker gets its model from --model instead.
_NOT_FOR_WORKERS = frozenset({"models", "host", "port", "max_body_bytes", "max_long_poll_s", "lag_interval_s"})
# A drained worker still closes its clients and the interpreter after the drain deadline.
EXIT_GRACE_S = 10.0


PR_SET_PDEATHSIG = 1


def terminate_with_parent() -> None:
    """Runs in a worker's child process before exec: SIGTERM when the autoscaler that started it dies (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def settings_env(settings: FleetSettings) -> dict[str, str]:
    """``FLEET_*`` variables that give a child process the same broker, store and worker settings.

    Only settings that were set (by the environment, a flag or the caller) are passed, so a worker still uses its
    model's preferred batch limits where the user did not override them.
    """
    names = (set(settings.model_fields_set) | {"broker_url", "store_url"}) - _NOT_FOR_WORKERS
    return {f"FLEET_{name.upper()}": _env_value(getattr(settings, name)) for name in sorted(names)}


def _env_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):  # FLEET_ROUTING, FLEET_MAX_QUEUED_PER_MODEL: the JSON object form parses back
        return json.dumps(value)
    return str(value)


@dataclass(slots=True)
class WorkerProcess:
    """One ``fleet worker`` process this backend started."""

    model: str
    index: int
    process: asyncio.subprocess.Process
    log_path: Path | None = None
    draining: bool = False
    reaper: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.returncode is None


class ProcessBackend:
    """Scales ``fleet worker --model REF`` processes on this machine.

    Args:
        settings: broker and store URLs and worker settings, passed to each process as ``FLEET_*`` variables.
            The in-memory broker or store cannot be shared between processes: use the ``inprocess`` backend there.
        worker_args: extra ``fleet worker`` arguments per model name (e.g. ``["--device", "cuda:1"]``).
        env: extra environment variables for every worker (on top of this process's environment and ``settings``).
        python: the interpreter that runs ``-m fleet.cli``.
        refs: the ``--model`` reference per model name where it is not the name itself (an import path such as
            ``mypkg.models:Ranker``, a pinned repository entry ``sentiment@2``); by default taken from
            ``settings.models``.
        log_dir: write each worker's output to ``log_dir/<model>-<n>.log`` instead of this process's stdout/stderr.
        stop_timeout_s: how long a SIGTERMed worker may take to exit before it is killed; default the drain
            timeout plus ``EXIT_GRACE_S``.
        pools: the model references per pool name (default ``settings.pools``): a pool's replicas are
            ``fleet worker --models`` processes serving them all.

    Raises:
        ConfigError: the broker or store is in-memory.
    """

    name = "process"

    def __init__(
        self,
        settings: FleetSettings,
        *,
        worker_args: Mapping[str, Sequence[str]] | None = None,
        env: Mapping[str, str] | None = None,
        python: str = sys.executable,
        refs: Mapping[str, str] | None = None,
        log_dir: Path | None = None,
        stop_timeout_s: float | None = None,
        pools: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        if settings.broker_scheme == "memory" or settings.store_scheme == "memory":
            raise ConfigError(
                "the process backend starts separate 'fleet worker' processes, which cannot share the embedded "
                "in-memory broker or store: use the inprocess backend with memory://, or a real broker "
                "(nats://, kafka://) and store (redis://)"
            )
        self.settings = settings
        self._worker_args = {model: list(args) for model, args in (worker_args or {}).items()}
        self._env = {**os.environ, **settings_env(settings), **(env or {})}
        self._python = python
        self._refs = dict(refs) if refs is not None else _refs_from(settings.models, Repository.from_settings(settings))
        self._pools = {name: list(members) for name, members in (settings.pools if pools is None else pools).items()}
        self.log_dir = log_dir
        self._stop_timeout_s = settings.drain_timeout_s + EXIT_GRACE_S if stop_timeout_s is None else stop_timeout_s
        self._workers: dict[str, list[WorkerProcess]] = {}
        self._counter = itertools.count(1)
        self._lock = asyncio.Lock()
        self._closed = False

    # -- the ScalerBackend protocol ---------------------------------------------------------------------------
    async def current_replicas(self, model: str) -> int:
        return len(self.workers(model))

    async def set_replicas(self, model: str, replicas: int) -> None:
        check_replicas(model, replicas)
        async with self._lock:
            if self._closed:
                raise ScalerError("the process backend is closed", backend=self.name, target=model, retriable=False)
            live = self.workers(model)
            for _ in range(replicas - len(live)):
                await self._spawn(model)
            for worker in reversed(live[replicas:]):  # the newest first: the oldest have warmed up
                self._terminate(worker)
            if replicas != len(live):
                log.info("process: %s scaled from %d to %d workers", model, len(live), replicas)

    async def close(self) -> None:
        """SIGTERM every worker, wait for them to drain within the stop timeout, SIGKILL the rest. Idempotent."""
        async with self._lock:
            self._closed = True
            for model in list(self._workers):
                for worker in self.workers(model):
                    self._terminate(worker)
            reapers = [w.reaper for ws in self._workers.values() for w in ws if w.reaper is not None]
        await asyncio.gather(*reapers, return_exceptions=True)

    # -- inspection -------------------------------------------------------------------------------------------
    def workers(self, model: str) -> list[WorkerProcess]:
        """Live, non-draining workers of ``model``, oldest first; forgets the ones that died on their own."""
        workers = self._workers.get(model, [])
        for worker in [w for w in workers if not w.alive and not w.draining]:
            log.warning(
                "process: worker %d of %s (pid %d) exited with code %s; it is no longer counted (output: %s)",
                worker.index,
                model,
                worker.pid,
                worker.process.returncode,
                worker.log_path or "this process's stderr",
            )
            workers.remove(worker)
        return [w for w in workers if not w.draining]

    def draining(self, model: str) -> list[WorkerProcess]:
        """Workers of ``model`` that were told to stop and have not exited yet."""
        return [w for w in self._workers.get(model, []) if w.draining]

    # -- internals --------------------------------------------------------------------------------------------
    def argv(self, model: str) -> list[str]:
        """The command of one worker of ``model``, or of the pool named ``model``."""
        pool = self._pools.get(model)
        serve = ["--models", models_flag(pool)] if pool is not None else ["--model", self._refs.get(model, model)]
        return [self._python, "-m", "fleet.cli", "worker", *serve, *self._worker_args.get(model, [])]

    async def _spawn(self, model: str) -> WorkerProcess:
        index = next(self._counter)
        log_path = self.log_dir / f"{model}-{index}.log" if self.log_dir is not None else None
        argv = self.argv(model)
        try:
            with _output(log_path) as out:
                process = await asyncio.create_subprocess_exec(
                    *argv,
                    env=self._env,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                    preexec_fn=terminate_with_parent,
                )
        except OSError as exc:
            raise ScalerError(
                f"cannot start a worker for model {model!r} ({' '.join(argv)}): {exc}",
                backend=self.name,
                target=model,
                retriable=False,
            ) from exc
        worker = WorkerProcess(model, index, process, log_path)
        self._workers.setdefault(model, []).append(worker)
        log.info("process: started worker %d of %s (pid %d)", index, model, process.pid)
        return worker

    def _terminate(self, worker: WorkerProcess) -> None:
        worker.draining = True
        if worker.alive:
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(signal.SIGTERM)
        worker.reaper = asyncio.create_task(self._reap(worker), name=f"reap-{worker.model}-{worker.index}")

    async def _reap(self, worker: WorkerProcess) -> None:
        """Wait for a SIGTERMed worker to drain and exit; kill it past the stop timeout; then forget it."""
        try:
            try:
                async with asyncio.timeout(self._stop_timeout_s):
                    code = await worker.process.wait()
            except TimeoutError:
                log.warning(
                    "process: worker %d of %s (pid %d) did not exit within %.1fs of SIGTERM; killing it",
                    worker.index,
                    worker.model,
                    worker.pid,
                    self._stop_timeout_s,
                )
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()
                code = await worker.process.wait()
            log.info(
                "process: worker %d of %s (pid %d) exited with code %s", worker.index, worker.model, worker.pid, code
            )
        finally:
            with contextlib.suppress(ValueError):
                self._workers.get(worker.model, []).remove(worker)


@contextlib.contextmanager
def _output(path: Path | None) -> Iterator[IO[bytes] | None]:
    """The file a worker writes its output to, or None to inherit this process's stdout and stderr."""
    if path is None:
        yield None
        return
    with path.open("ab") as out:
        yield out


def _refs_from(models: Sequence[str], repository: Repository) -> dict[str, str]:
    """Model name -> ``--model`` reference, for the references in the settings that are not the name itself (import
    paths, repository entries pinned as ``name@version``)."""
    refs: dict[str, str] = {}
    for ref in models:
        if ":" in ref or "." in ref or "@" in ref:
            refs[resolve_spec(ref, repository).name] = ref
    return refs
