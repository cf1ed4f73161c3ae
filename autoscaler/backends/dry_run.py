"""``dry-run``: decide but do not act. Records every request, so a run can be inspected or replayed."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import NamedTuple

from fleet.autoscaler.backends.base import check_replicas

log = logging.getLogger(__name__)


class ScaleCall(NamedTuple):
    """One ``set_replicas`` request: the model, the replica count asked for and when (unix seconds)."""

    model: str
    replicas: int
    at: float


class DryRunBackend:
    """Records ``set_replicas`` calls and reports the last one as the current count; runs nothing.

    Args:
        initial: replicas reported for a model that has not been scaled yet (default 0).
    """

    name = "dry-run"

    def __init__(self, initial: Mapping[str, int] | None = None) -> None:
        self.calls: list[ScaleCall] = []
        self._replicas: dict[str, int] = dict(initial or {})

    async def current_replicas(self, model: str) -> int:
        return self._replicas.get(model, 0)

    async def set_replicas(self, model: str, replicas: int) -> None:
        check_replicas(model, replicas)
        self.calls.append(ScaleCall(model, replicas, time.time()))
        log.info("dry-run: %s would scale from %d to %d", model, self._replicas.get(model, 0), replicas)
        self._replicas[model] = replicas

    async def close(self) -> None:
        return None
