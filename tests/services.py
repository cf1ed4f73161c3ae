"""Start real Redis and NATS JetStream servers for the test session, or use ones already running.

``FLEET_TEST_REDIS_URL`` / ``FLEET_TEST_NATS_URL`` point the tests at running servers. Otherwise each server is
started on a free port in a temporary directory and stopped at the end. A server that cannot be started fails
the run with a message that says what to install: nothing is skipped for lack of a service.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from fleet.errors import ServiceUnavailable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def wait_port(host: str, port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_open(host, port):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise ServiceUnavailable(what, f"it did not start listening on {host}:{port} within {timeout_s}s. Log:\n{tail}")


def require_binary(name: str, package: str, service: str | None = None) -> str:
    path = shutil.which(name)
    if path is None:
        raise ServiceUnavailable(
            service or name,
            f"'{name}' is not installed. Install it with 'apt-get install {package}' "
            "(the README's test command, 'make test', does this for you).",
        )
    return path


def die_with_parent() -> None:
    """Runs in a server's child process before exec: a test run killed outright takes its servers with it."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_server(argv: list[str], workdir: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """Start a server process logging to ``workdir/server.log``."""
    log = workdir / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=workdir, preexec_fn=die_with_parent)
    return proc, log


def stop_server(proc: subprocess.Popen[bytes], timeout_s: float = 10) -> None:
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def _server(argv: list[str], port: int, workdir: Path, what: str, timeout_s: float = 20) -> Iterator[None]:
    proc, log = start_server(argv, workdir)
    try:
        wait_port("127.0.0.1", port, proc, log, timeout_s, what)
        yield
    finally:
        stop_server(proc)


@contextlib.contextmanager
def redis_server(wrapper: Sequence[str] = (), timeout_s: float = 20) -> Iterator[str]:
    """A redis-server without persistence (FLEET_TEST_REDIS_URL's instead, unless ``wrapper`` is given: a command
    the server runs under, such as valgrind for ``benchmarks.bench_instructions``); its URL."""
    url = os.environ.get("FLEET_TEST_REDIS_URL")
    if url and not wrapper:
        yield url
        return
    binary = require_binary("redis-server", "redis-server")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="fleet-redis-") as tmp:
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp]
        with _server([*wrapper, *argv], port, Path(tmp), "redis-server", timeout_s):
            yield f"redis://127.0.0.1:{port}/0"


@contextlib.contextmanager
def nats_server() -> Iterator[str]:
    url = os.environ.get("FLEET_TEST_NATS_URL")
    if url:
        yield url
        return
    binary = require_binary("nats-server", "nats-server")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="fleet-nats-") as tmp:
        argv = [binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", tmp]
        with _server(argv, port, Path(tmp), "nats-server"):
            yield f"nats://127.0.0.1:{port}"


CLUSTER_PRIMARIES = 3


@contextlib.contextmanager
def redis_cluster(primaries: int = CLUSTER_PRIMARIES, timeout_s: float = 60) -> Iterator[str]:
    """A real Redis Cluster of ``primaries`` primaries (no replicas) on free ports: ``redis+cluster://`` URL.

    ``FLEET_TEST_REDIS_CLUSTER_URL`` points the tests at a running cluster instead. Each node runs
    ``redis-server --cluster-enabled yes`` in its own directory; ``redis-cli --cluster create`` assigns the slots,
    and the cluster is used once every node reports ``cluster_state:ok``.
    """
    url = os.environ.get("FLEET_TEST_REDIS_CLUSTER_URL")
    if url:
        yield url
        return
    binary = require_binary("redis-server", "redis-server", "Redis Cluster")
    cli = require_binary("redis-cli", "redis-tools", "Redis Cluster")
    ports = [_cluster_port() for _ in range(primaries)]
    with tempfile.TemporaryDirectory(prefix="fleet-redis-cluster-") as tmp, contextlib.ExitStack() as stack:
        for port in ports:
            workdir = Path(tmp) / str(port)
            workdir.mkdir()
            argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--dir", str(workdir)]
            stack.enter_context(_server(argv, port, workdir, "Redis Cluster node"))
        _create_cluster(cli, ports, timeout_s)
        yield "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in ports)


def _cluster_port() -> int:
    """A free port whose cluster bus port (10000 above it, so at most 55535) is free too."""
    for _ in range(100):
        port = free_port()
        if port <= 55535 and not port_open("127.0.0.1", port + 10000):
            with contextlib.suppress(OSError), socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
                return port
    raise ServiceUnavailable("Redis Cluster", "found no free port pair (port, port + 10000) for a node")


def _create_cluster(cli: str, ports: list[int], timeout_s: float) -> None:
    nodes = [f"127.0.0.1:{port}" for port in ports]
    argv = [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise ServiceUnavailable("Redis Cluster", f"'redis-cli --cluster create' failed:\n{done.stdout}{done.stderr}")
    deadline = time.monotonic() + timeout_s
    waiting = list(ports)
    while waiting and time.monotonic() < deadline:
        info = subprocess.run(
            [cli, "-p", str(waiting[0]), "cluster", "info"], capture_output=True, text=True, timeout=10, check=False
        )
        if "cluster_state:ok" in info.stdout:
            waiting.pop(0)
        else:
            time.sleep(0.1)
    if waiting:
        raise ServiceUnavailable("Redis Cluster", f"node 127.0.0.1:{waiting[0]} did not reach cluster_state:ok")
