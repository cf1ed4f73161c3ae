"""``sleep``: a synthetic service time, for scheduling and autoscaling experiments.

Each job draws a service time from its ``distribution`` with mean ``mean_ms`` (the mean of the distribution in
all three cases), multiplies it by the worker's ``slowness`` factor and sleeps that long. A batch sleeps its
items one after another (the batch takes the sum of their times), as a device that gains nothing from batching
would.
"""

from __future__ import annotations

import math
import random
import time

from fleet.consumers.handlers.base import ModelHandler
from fleet.schemas.models import SLEEP, SLEEP_MAX_MS, SleepInput, SleepOutput


def draw_service_ms(item: SleepInput, slowness: float, rng: random.Random) -> float:
    """Draw one service time in milliseconds: ``draw(distribution, mean_ms, sigma) * slowness``.

    ``fixed`` is exactly ``mean_ms``; ``exponential`` has rate ``1 / mean_ms``; ``lognormal`` has shape ``sigma``
    and ``mu = ln(mean_ms) - sigma**2 / 2``, so its mean is ``mean_ms``. One draw is capped at ``SLEEP_MAX_MS``
    (before the slowness factor) so that a far tail cannot hold a worker for hours. If ``item.seed`` is set the
    draw comes from ``random.Random(seed)`` and is reproducible; otherwise from ``rng``.
    """
    if item.seed is not None:
        rng = random.Random(item.seed)
    mean_ms = item.mean_ms
    if mean_ms <= 0 or item.distribution == "fixed":
        drawn_ms = mean_ms
    elif item.distribution == "exponential":
        drawn_ms = rng.expovariate(1.0 / mean_ms)
    else:
        mu = math.log(mean_ms) - item.sigma**2 / 2
        drawn_ms = rng.lognormvariate(mu, item.sigma)
    return min(drawn_ms, SLEEP_MAX_MS) * slowness


class SleepHandler(ModelHandler[SleepInput, SleepOutput]):
    """Sleeps a drawn service time per item; ``slept_ms`` in the output is the drawn time (scheduling jitter of
    the operating system comes on top and is not reported)."""

    spec = SLEEP
    replica_safe = True  # time.sleep and a shared random.Random (its draws are atomic under the GIL)

    def __init__(self, *, device: str = "cpu", slowness: float = 1.0, rng_seed: int | None = None) -> None:
        """Args:
        rng_seed: seeds this worker's generator for items that carry no ``seed`` of their own.
        """
        super().__init__(device=device, slowness=slowness)
        self._rng = random.Random(rng_seed)

    def predict(self, batch: list[SleepInput]) -> list[SleepOutput | Exception]:
        outputs: list[SleepOutput | Exception] = []
        for item in batch:
            slept_ms = draw_service_ms(item, self.slowness, self._rng)
            time.sleep(slept_ms / 1000)
            outputs.append(SleepOutput(slept_ms=slept_ms, slowness=self.slowness))
        return outputs

    def sample_input(self) -> SleepInput:
        return SleepInput.model_validate({"mean_ms": 0})
