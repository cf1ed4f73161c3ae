"""User-style model handlers for tests, importable by path (``tests.handlers_for_tests:Flaky``).

Subprocess workers pick their model name up from ``FLEET_TEST_MODEL_NAME`` so each test gets its own subject.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from pydantic import BaseModel, ConfigDict

from consumers.handlers.base import ModelHandler
from schemas.models import ModelSpec


class ItemIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    value: int = 0
    boom: bool = False  # the whole batch raises while this item is in it
    bad: bool = False  # this item alone comes back as an exception
    sleep_ms: float = 0.0


class ItemOut(BaseModel):
    value: int
    batch_size: int


_NAME = os.environ.get("FLEET_TEST_MODEL_NAME", "testitems")


class Items(ModelHandler[ItemIn, ItemOut]):
    """Doubles ``value``; ``boom`` poisons its batch; ``bad`` fails its own item; counts every predicted item."""

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
