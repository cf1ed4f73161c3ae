"""The result-store seam: job records with atomic state transitions and completion notifications.

Contract (checked by ``tests/contract/test_store_contract.py`` on Redis and on the in-memory store):

* Records live ``job_ttl_s`` seconds after their last write.
* ``create`` writes only when no record exists (idempotent submit).
* ``start`` moves a non-terminal job to ``running`` (creating it when absent: requests published straight to the
  topic have no record yet) and never touches a terminal one.
* ``finish`` is one atomic compare-and-set: the first terminal state wins and never changes again; the winner's
  record is announced to waiters. It returns ``(True, record)`` for the winner, ``(False, current)`` otherwise.
* ``get_many`` reads a batch of records in one round trip (``None`` for an unknown job), in order.
* ``start_many`` / ``finish_many`` write an item's ``version`` (the model version that runs or answered the job) into
  its record; an item without one leaves the record's version as it was. An item's ``device_seconds`` (its share
  of its batch's compute, ``fleet.consumers.usage``) goes into the terminal record it writes.
* ``start_many`` / ``finish_many`` do the same for a micro-batch in a few round trips (one result per item, in
  order); a worker uses them so that the store costs a handful of round trips per batch, not per job. They leave a
  record of another model or another tenant than the item's untouched (``transitions.foreign``): ``start_many``
  returns it as it is, ``finish_many`` returns ``(False, it)``. ``start`` and ``finish`` (a record's owner: the
  gateway's cancel, cache hit and reconcile) do not check.
* ``create(record, message)`` also marks the job *unpublished*, keeping its request message, atomically with the
  record; ``published`` clears the mark once the broker acknowledged the message, ``delete`` clears it with the
  record. ``claim_unpublished(older_than_s, limit)`` returns the jobs marked longer ago than that, with their
  messages (None when lost), and restarts their clock, so that concurrent sweeps (one per gateway) each get
  different jobs and a job claimed by a sweep that died is claimed again ``older_than_s`` later.
* Every record a store creates (``create``, or a ``start`` / ``finish`` and their batch forms that find none) is
  entered in the job index (``fleet.store.jobindex``: per tenant and per tenant and model, scored by
  ``created_at``, kept as long as the record TTL). ``index_page`` reads it newest first from a position;
  ``index_forget`` removes entries whose records are gone.
* ``wait`` returns the terminal record as soon as it exists, also when the job finished before the call; on
  timeout it returns the current (non-terminal) record, or ``None`` for an unknown job. A store outage shorter
  than the timeout is no error: the waiter retries its reads with backoff and returns the terminal record once the
  store is back, also when the completion notice was lost. Only a record it cannot read at the deadline raises
  ``StoreError`` (retriable; not retriable when the stored record itself is corrupt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from fleet.schemas.jobs import JobError, JobRecord, JobState, StageTimings
from fleet.store.jobindex import Position, Scope


@dataclass(slots=True)  # not frozen: built for every job, and a frozen __init__ costs 3x
class Start:
    """One item of ``start_many``: the arguments of ``start``."""

    job_id: str
    model: str
    worker_id: str
    deliveries: int
    unread: bool = False
    """The worker did not read the record before (a DAG step's first delivery: the runner publishes it without
    one). The store then expects none; where one exists, ``deliveries`` counts on from its runs."""
    tenant: str | None = None
    """The request message's tenant: written into a record the start creates (None: the default tenant)."""
    batch_size: int | None = None
    """How many jobs the run starts with (``fleet.consumers.crashes``: 0 marks a draining worker's runs)."""
    strikes: int = 0
    """The job's runs counted against it so far (``fleet.consumers.crashes``); a record keeps the larger count."""
    version: str | None = None
    """The model version the run computes with: written into the record (None: the record keeps its own)."""


@dataclass(slots=True)  # not frozen: built for every job, and a frozen __init__ costs 3x
class Finish:
    """One item of ``finish_many``: the arguments of ``finish``."""

    job_id: str
    state: JobState
    model: str
    output: Any = None
    error: JobError | None = None
    worker_id: str | None = None
    tenant: str | None = None  # written into a record the finish creates (a job that had none)
    version: str | None = None  # the model version that answered (None: the record keeps its own)
    device_seconds: float | None = None  # the job's share of its batch's compute time (None: it did not compute)
    timings: StageTimings | None = None  # the run's stage instants; the store sets ``stored`` as it writes
    trace_id: str | None = None  # the job's W3C trace id, when it was traced


class ResultStore(Protocol):
    scheme: str  # "memory" or "redis"

    async def connect(self) -> None:
        """Raise ``StoreError`` with a message naming the URL when the store cannot be reached."""

    async def close(self) -> None: ...

    async def ping(self) -> None: ...

    async def create(self, record: JobRecord, message: bytes | None = None) -> bool:
        """Write ``record`` if its job id is new (True), else nothing (False). With ``message`` (the request as
        published) the job is also marked unpublished until ``published``. A terminal ``record`` (an answer known
        at once) is announced to the job's waiters like a finish, and ``message`` is not kept."""

    async def get(self, job_id: str) -> JobRecord | None: ...

    async def get_many(self, job_ids: list[str]) -> list[JobRecord | None]: ...

    async def delete(self, job_id: str) -> None: ...

    async def published(self, job_id: str) -> None: ...

    async def claim_unpublished(self, older_than_s: float, limit: int) -> list[tuple[str, bytes | None]]: ...

    async def start(self, job_id: str, *, model: str, worker_id: str, deliveries: int) -> JobRecord: ...

    async def finish(
        self,
        job_id: str,
        state: JobState,
        *,
        model: str,
        output: Any = None,
        error: JobError | None = None,
        worker_id: str | None = None,
    ) -> tuple[bool, JobRecord]: ...

    async def start_many(self, items: list[Start]) -> list[JobRecord]: ...

    async def finish_many(self, items: list[Finish]) -> list[tuple[bool, JobRecord]]: ...

    async def index_page(
        self, scope: Scope, since: float | None, until: float | None, position: Position | None, count: int
    ) -> list[Position]:
        """Up to ``count`` entries of ``scope``'s job index strictly after ``position`` (None: the newest), newest
        first (ties by job id, descending), with ``since <= created_at <= until`` (None: unbounded)."""

    async def index_forget(self, scope: Scope, entries: list[Position]) -> None: ...

    async def wait(self, job_id: str, timeout_s: float) -> JobRecord | None: ...
