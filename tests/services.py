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
from collections.abc import Iterator
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
def redis_server() -> Iterator[str]:
    url = os.environ.get("FLEET_TEST_REDIS_URL")
    if url:
        yield url
        return
    binary = require_binary("redis-server", "redis-server")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="fleet-redis-") as tmp:
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", tmp]
        with _server(argv, port, Path(tmp), "redis-server"):
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
