"""``chaos``: the ``sleep`` model with a fixed service time that records every job it computes.

``benchmarks.chaos`` serves it with ``fleet worker --model benchmarks.chaos_model:CountingSleep``. Each input
carries its own job id (``job``), because a handler sees inputs, not messages. After computing an item the handler
appends one line ``<job> <started> <ended>\\n`` (unix seconds) to ``computed-<pid>.log`` in the directory named by
``CHAOS_COMPUTED_DIR``, with one ``os.write`` on an ``O_APPEND`` descriptor: the line is in the file the moment the
call returns, so a SIGKILL a microsecond later loses nothing, and workers never interleave within a line.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pydantic import Field

from fleet.consumers.handlers.sleep import SleepHandler, draw_service_ms
from fleet.errors import ConfigError
from fleet.schemas.models import ModelSpec, SleepInput, SleepOutput

COMPUTED_DIR_ENV = "CHAOS_COMPUTED_DIR"
MODEL = "chaos"


class CountingInput(SleepInput):
    """A ``sleep`` input that names the job it belongs to."""

    job: str = Field("", max_length=128, description="the job id, recorded when the item is computed")
    mean_ms: float = Field(2.0, ge=0, le=1000, description="fixed service time in milliseconds")


def computed_line(job: str, started: float, ended: float) -> bytes:
    return f"{job} {started:.6f} {ended:.6f}\n".encode()


def parse_computed_line(line: str) -> tuple[str, float, float] | None:
    """``(job, started, ended)`` of one line, or None for a line cut short (a write never is; a copy may be)."""
    parts = line.split()
    if len(parts) != 3:
        return None
    try:
        return parts[0], float(parts[1]), float(parts[2])
    except ValueError:
        return None


class CountingSleep(SleepHandler):
    """``sleep`` with a small fixed service time (2 ms per item, batches of up to 8) that records what it computes."""

    spec = ModelSpec(
        MODEL, CountingInput, SleepOutput, max_batch=8, max_wait_ms=2, description="sleep that records each job"
    )

    def __init__(self, *, device: str = "cpu", slowness: float = 1.0) -> None:
        super().__init__(device=device, slowness=slowness)
        self._fd: int | None = None

    def load(self) -> None:
        # The worker CLI builds handlers with device and slowness only, so the benchmark that starts this worker
        # passes the log directory in the environment; the handler reads it once, here.
        folder = os.environ.get(COMPUTED_DIR_ENV)
        if not folder or not Path(folder).is_dir():
            raise ConfigError(f"{COMPUTED_DIR_ENV} must name an existing directory (got {folder!r})")
        path = Path(folder) / f"computed-{os.getpid()}.log"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def predict(self, batch: list[CountingInput]) -> list[SleepOutput | Exception]:  # type: ignore[override]
        outputs: list[SleepOutput | Exception] = []
        for item in batch:
            started = time.time()
            slept_ms = draw_service_ms(item, self.slowness, self._rng)
            time.sleep(slept_ms / 1000)
            if item.job and self._fd is not None:
                os.write(self._fd, computed_line(item.job, started, time.time()))
            outputs.append(SleepOutput(slept_ms=slept_ms, slowness=self.slowness))
        return outputs

    def sample_input(self) -> CountingInput:
        return CountingInput(mean_ms=0)  # no job id: the warm-up is not recorded

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
