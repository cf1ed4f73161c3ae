"""Device time per job: a batch's compute seconds shared by its items' costs, and a settled batch's usage rows.

The worker times each batch's compute (the model call, on its thread) and hands each job its share in proportion
to the handler's ``cost(input)`` of its request (``Job.cost``: weighed when fetched for a batch with a cost budget,
else here, once, after the compute; a handler that keeps the default cost of 1 is not asked, and a ``cost`` that
raises counts 1, so a batch without costs is shared equally). The shares sum to the batch's time. The settler
writes a job's share into its terminal record (``JobRecord.device_seconds``) and, once per settled batch, adds the
records it made terminal to ``fleet_device_seconds_total`` and to the usage counts (``fleet.consumers.usage_buffer``
writes them to ``fleet.store.usage``). Pure functions (``weigh`` asks the handler).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from fleet.consumers.handlers.base import ModelHandler
from fleet.consumers.requests import Job
from fleet.schemas.jobs import JobRecord
from fleet.store.usage import UsageCount, UsageKey
from fleet.tenancy import owner

log = logging.getLogger(__name__)


def weigh(jobs: list[Job], handler: ModelHandler[Any, Any]) -> None:
    """Set ``Job.cost`` where the fetch did not: the handler's ``cost`` of each input (not asked when the handler
    keeps the default, 1 for every input)."""
    if type(handler).cost is ModelHandler.cost:
        return
    for job in jobs:
        if job.cost is None and job.input is not None:
            try:
                job.cost = int(handler.cost(job.input))
            except Exception:
                log.exception("the cost() of %s raised; its job counts 1", handler.spec.name)


def share_device_seconds(jobs: list[Job], seconds: float) -> None:
    """Set each job's ``device_seconds``: ``seconds`` shared in proportion to its cost (None counts 1)."""
    costs = [max(job.cost, 0) if job.cost is not None else 1 for job in jobs]
    total = sum(costs)
    if total <= 0:  # every cost 0: nothing tells them apart
        costs, total = [1] * len(jobs), len(jobs)
    for job, cost in zip(jobs, costs, strict=True):
        job.device_seconds = seconds * cost / total


def device_kind(device: str) -> str:
    """The kind of a torch device a price applies to: ``cuda:1`` -> ``cuda``, ``cpu`` -> ``cpu``."""
    return device.split(":", 1)[0] or "cpu"


def usage_of(settled: Iterable[tuple[Job, JobRecord, bool]], device: str) -> dict[UsageKey, UsageCount]:
    """What a settled batch adds to the usage counts: the records this worker made terminal with a share of
    device time (computed jobs), summed per tenant, model, version and device kind. A duplicate delivery's record
    (not won here) and a job that never computed (rejected, expired) add nothing."""
    kind = device_kind(device)
    counts: dict[UsageKey, UsageCount] = {}
    for job, record, won in settled:
        if not won or record.device_seconds is None:
            continue
        key = UsageKey(owner(record.tenant), record.model, record.version or "", kind)
        count = counts.get(key)
        if count is None:
            count = counts[key] = UsageCount()
        count.jobs += 1
        count.items += job.cost if job.cost is not None else 1
        count.device_seconds += record.device_seconds
    return counts
