"""A redis-server of one test's own, persisted to an append-only file, that the test may SIGKILL and restart on the
same port: what it acknowledged before the kill is there again after the restart (``--appendfsync always``)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests import services


class AofRedis:
    """``start``, ``kill`` (SIGKILL, no shutdown save), ``start`` again: the same port, the same data."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = services.free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def argv(self) -> list[str]:
        binary = services.require_binary("redis-server", "redis-server")
        return [
            binary,
            *("--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir)),
            *("--save", "", "--appendonly", "yes", "--appendfsync", "always"),
        ]

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        log = self.workdir / f"server-{self.starts}.log"
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.argv(), stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir, preexec_fn=services.die_with_parent
            )
        services.wait_port("127.0.0.1", self.port, self.proc, log, 20, "redis-server")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            services.stop_server(self.proc)


@contextlib.contextmanager
def aof_redis() -> Iterator[AofRedis]:
    with tempfile.TemporaryDirectory(prefix="fleet-redis-aof-") as tmp:
        server = AofRedis(Path(tmp))
        server.start()
        try:
            yield server
        finally:
            server.stop()
