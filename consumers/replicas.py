"""Replicas: one worker computes N batches of its model at once, on one copy of the weights.

The worker's model executor is a pool of N threads (``model_executor``). A batch runs in one of them from start to
end; N batches run at once because torch releases the GIL in its kernels (tokenising, padding and building outputs
hold it, so the gain is in the model's share of a batch). Each thread calls the handler's ``start_replica`` once
before its first batch: a torch runtime sets that thread's intra-op thread count (``replica_threads``: the worker's
cores shared among its replicas, so N replicas on C cores do not start N x C threads), its own CUDA stream on a GPU
(kernels of different replicas overlap on the device) and its own tokenizer copy (a fast tokenizer is not safe to
call from two threads at once). With N = 1 the executor is one thread and ``start_replica`` is never called: the
worker behaves as it always did.

The memory saved is the weights: N processes hold N copies, N replicas one, plus N batches' activations either way.
A handler must declare ``replica_safe = True`` (``ModelHandler``) to be run by several threads; ``check_replicas``
refuses N > 1 otherwise, and for a model computed inline on the event loop (``ModelSpec.inline``).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fleet.consumers.handlers.base import ModelHandler
from fleet.errors import ConfigError

MAX_REPLICAS = 64


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def replica_threads(replicas: int, cores: int | None = None) -> int:
    """Intra-op threads for each of ``replicas`` replicas: the cores shared among them, at least one each."""
    return max(1, (cores or usable_cores()) // replicas)


def check_replicas(handler: ModelHandler[Any, Any], replicas: int) -> None:
    """Raises ``ConfigError`` (one line naming the model and the count) when ``handler`` cannot run ``replicas``."""
    name = handler.spec.name
    if not 1 <= replicas <= MAX_REPLICAS:
        raise ConfigError(f"replicas of model {name!r} must be 1 to {MAX_REPLICAS}, got {replicas}")
    if replicas == 1:
        return
    if handler.spec.inline:
        raise ConfigError(
            f"model {name!r} computes inline on the worker's event loop, so replicas ({replicas}) cannot run it at "
            "once; serve it with replicas 1"
        )
    if not handler.replica_safe:
        raise ConfigError(
            f"model {name!r} ({type(handler).__qualname__}) does not declare replica_safe = True, so its predict is "
            f"not known to be safe in {replicas} threads at once; use replicas 1 (or several worker processes), or "
            "make its per-call state per thread and set replica_safe"
        )


_thread = threading.local()


def in_replica() -> bool:
    """Whether the calling thread is one of several replica threads of a worker: a handler keeps its per-call state
    per thread there (any handler instance it runs, a model pool's included)."""
    return bool(getattr(_thread, "replica", False))


def _start_replica(handler: ModelHandler[Any, Any], threads: int) -> None:
    _thread.replica = True
    handler.start_replica(threads)


def model_executor(handler: ModelHandler[Any, Any], replicas: int, name: str) -> ThreadPoolExecutor:
    """The threads a worker computes its batches in: one per replica; each replica thread starts with
    ``handler.start_replica(replica_threads(replicas))`` when there are several."""
    if replicas == 1:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    threads = replica_threads(replicas)
    return ThreadPoolExecutor(
        max_workers=replicas, thread_name_prefix=name, initializer=_start_replica, initargs=(handler, threads)
    )
