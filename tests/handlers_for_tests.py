"""User-style model handlers for tests, importable by path (``tests.handlers_for_tests:Flaky``).

Subprocess workers pick their model name up from ``FLEET_TEST_MODEL_NAME`` so each test gets its own subject.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from fleet.consumers.handlers.base import ModelHandler
from fleet.errors import ModelError
from fleet.schemas.models import ModelSpec


class ItemIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    value: int = 0
    boom: bool = False  # the whole batch raises while this item is in it
    bad: bool = False  # this item alone comes back as an exception
    sleep_ms: float = 0.0
    crash: bool = False  # SIGKILLs the worker process whenever its batch computes (a job that kills workers)


class ItemOut(BaseModel):
    value: int
    batch_size: int


_NAME = os.environ.get("FLEET_TEST_MODEL_NAME", "testitems")


class Items(ModelHandler[ItemIn, ItemOut]):
    """Doubles ``value``; ``boom`` poisons its batch; ``bad`` fails its own item; ``crash`` kills the process;
    counts every predicted item."""

    spec = ModelSpec(_NAME, ItemIn, ItemOut, max_batch=16, max_wait_ms=20)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: list[list[int]] = []
        self._lock = threading.Lock()

    def predict(self, batch: list[ItemIn]) -> list[ItemOut | Exception]:
        with self._lock:
            self.calls.append([item.value for item in batch])
        if any(item.boom for item in batch):
            raise RuntimeError("boom: this batch contains a poison item")
        if any(item.crash for item in batch):
            os.kill(os.getpid(), signal.SIGKILL)
        pause_s = sum(item.sleep_ms for item in batch) / 1000
        if pause_s:
            time.sleep(pause_s)
        return [
            ValueError(f"item {item.value} is bad")
            if item.bad
            else ItemOut(value=2 * item.value, batch_size=len(batch))
            for item in batch
        ]

    @property
    def predicted(self) -> list[int]:
        return [v for call in self.calls for v in call]


class SlowLoad(Items):
    """``Items`` whose ``load`` takes ``FLEET_TEST_LOAD_S`` seconds: a model that is slow to get warm."""

    def load(self) -> None:
        time.sleep(float(os.environ.get("FLEET_TEST_LOAD_S", "3")))


class StepsIn(BaseModel):
    """What a DAG step of the tests asks of ``Steps``: any JSON object, with a few keys that change the behaviour."""

    model_config = ConfigDict(extra="allow")

    key: str | None = None  # names this job in ``Steps.runs`` (a DAG input cannot see its own job id)
    fail_first: int = 0  # the first N runs of ``key`` fail retriably
    fail: bool = False  # fails for good (not retriable)
    sleep_ms: float = 0.0


class StepsOut(BaseModel):
    model_config = ConfigDict(extra="allow")


class Steps(ModelHandler[StepsIn, StepsOut]):
    """Echoes its input (as ``StepsOut``) and records every run per ``key`` in the class-level ``runs``, shared by
    every ``with_name`` copy in the process. ``fail_first``/``fail``/``sleep_ms`` make a step flaky, bad or slow."""

    spec = ModelSpec("steps", StepsIn, StepsOut, max_batch=16, max_wait_ms=2)
    runs: ClassVar[dict[str, int]] = {}
    _runs_lock = threading.Lock()

    def predict(self, batch: list[StepsIn]) -> list[StepsOut | Exception]:
        out: list[StepsOut | Exception] = []
        for item in batch:
            run = 0
            if item.key is not None:
                with self._runs_lock:
                    run = Steps.runs[item.key] = Steps.runs.get(item.key, 0) + 1
            if item.sleep_ms:
                time.sleep(item.sleep_ms / 1000)
            if item.fail:
                out.append(ModelError(f"step {item.key} fails for good", retriable=False))
            elif 0 < run <= item.fail_first:
                out.append(ModelError(f"step {item.key} fails its run {run}", retriable=True))
            else:
                out.append(StepsOut(**item.model_dump(exclude_unset=True)))
        return out


class GateIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str


class GateOut(BaseModel):
    key: str


class Gate(ModelHandler[GateIn, GateOut]):
    """Fails for good (not retriable, so the job is dead-lettered) until the file ``key`` exists in
    ``FLEET_TEST_GATE_DIR``: a job that fails, is fixed, and succeeds when its dead letter is redriven."""

    spec = ModelSpec("gate", GateIn, GateOut, max_batch=8, max_wait_ms=2)

    def predict(self, batch: list[GateIn]) -> list[GateOut | Exception]:
        gates = Path(os.environ.get("FLEET_TEST_GATE_DIR", "/nonexistent"))
        return [
            GateOut(key=item.key)
            if (gates / item.key).exists()
            else ModelError(f"gate {item.key} is closed", retriable=False)
            for item in batch
        ]


class Overlapping(Items):
    """``Items`` safe for replicas that records how many of its batches were computing at once (``peak``), and
    which threads computed them."""

    replica_safe = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.running = 0
        self.peak = 0
        self.threads: set[str] = set()
        self.started_threads: list[int] = []

    def start_replica(self, threads: int) -> None:
        with self._lock:
            self.started_threads.append(threads)

    def predict(self, batch: list[ItemIn]) -> list[ItemOut | Exception]:
        with self._lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
            self.threads.add(threading.current_thread().name)
        try:
            return super().predict(batch)
        finally:
            with self._lock:
                self.running -= 1


class Sick(Items):
    """``Items`` whose every batch raises while ``sick`` is set (a worker whose device broke), until healed."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sick = threading.Event()
        self.sick.set()

    def predict(self, batch: list[ItemIn]) -> list[ItemOut | Exception]:
        if self.sick.is_set():
            with self._lock:
                self.calls.append([])
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().predict(batch)
