"""Servers of one test's own that the test may SIGKILL and restart on the same port and data: a redis-server
persisted to an append-only file (what it acknowledged before the kill is there again after the restart, with
``--appendfsync always``), a nats-server with its JetStream directory, a single-node Kafka with its log dirs."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests import kafka_service, services


class Restartable:
    """``start``, ``kill`` (SIGKILL, no shutdown save), ``start`` again: the same port, the same data."""

    def __init__(self, argv: list[str], port: int, workdir: Path, what: str, url: str) -> None:
        self._argv, self.port, self.workdir, self.what, self.url = argv, port, workdir, what, url
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        log = self.workdir / f"server-{self.starts}.log"
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                self._argv, stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir, preexec_fn=services.die_with_parent
            )
        if self.what == "kafka":
            kafka_service._wait_ready(f"127.0.0.1:{self.port}", self.proc, log)
        else:
            services.wait_port("127.0.0.1", self.port, self.proc, log, 20, self.what)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            services.stop_server(self.proc)


AofRedis = Restartable  # the name the store and waiter tests use


def _argv(kind: str, port: int, workdir: Path) -> tuple[list[str], str]:
    if kind == "redis":
        binary = services.require_binary("redis-server", "redis-server")
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir)]
        return [*argv, "--save", "", "--appendonly", "yes", "--appendfsync", "always"], f"redis://127.0.0.1:{port}/0"
    if kind == "nats":
        binary = services.require_binary("nats-server", "nats-server")
        return [binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(workdir)], f"nats://127.0.0.1:{port}"
    java = services.require_binary("java", "openjdk-17-jre-headless", "Apache Kafka")
    jars = kafka_service.kafka_jars()
    config = kafka_service.write_config(workdir, port, services.free_port())
    kafka_service.format_storage(java, jars, workdir, config)
    return [*kafka_service._java_argv(java, jars, workdir, "kafka.Kafka"), str(config)], f"kafka://127.0.0.1:{port}"


@contextlib.contextmanager
def restartable(kind: str) -> Iterator[Restartable]:
    """A running ``redis`` (AOF), ``nats`` or ``kafka`` server of this test alone; stopped at the end."""
    port = services.free_port()
    with tempfile.TemporaryDirectory(prefix=f"fleet-{kind}-restartable-") as tmp:
        argv, url = _argv(kind, port, Path(tmp))
        server = Restartable(argv, port, Path(tmp), kind, url)
        server.start()
        try:
            yield server
        finally:
            server.stop()


def aof_redis() -> contextlib.AbstractContextManager[Restartable]:
    return restartable("redis")
