"""The seam between the autoscaler and whatever runs workers: a ``ScalerBackend`` sets a model's replica count.

Every backend scales in gracefully: a worker chosen to stop finishes its in-flight batch and hands its unfinished
messages back to the queue (the worker's SIGTERM drain), so no job is lost or finished twice.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class ScalerBackend(Protocol):
    """Reads and sets the number of workers serving each model.

    ``current_replicas`` counts workers that are starting or serving, not the ones draining after a scale-in.
    ``set_replicas`` returns once the change is under way (processes started or signalled, the Deployment patched);
    draining continues in the background. ``close`` is idempotent; backends that own their workers (process,
    inprocess) drain and stop them there.
    """

    name: str

    async def current_replicas(self, model: str) -> int: ...

    async def set_replicas(self, model: str, replicas: int) -> None: ...

    async def close(self) -> None: ...


def check_replicas(model: str, replicas: int) -> int:
    """A replica count must be a non-negative integer; anything else is a bug in the caller."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ValueError(f"replicas for model {model!r} must be an integer >= 0, not {replicas!r}")
    return replicas
