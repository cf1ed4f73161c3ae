"""The settle hook of versioned jobs: outcome counts per model version, and shadow outputs compared with answers.

A terminal record that names a model version (a traffic policy chose it, the job named it, or the worker wrote the
version that answered) is what the rollout controller and the breakers judge a version by:

1. **Outcomes.** Each such job this worker settled (``won``: its write made the record terminal, so a redelivery
   counts nothing twice) is counted for its version: ``succeeded`` as ok, ``failed`` as a failure (``expired`` and
   ``cancelled`` are no verdict on the version), with its end-to-end latency since ``submitted_at``
   (``RolloutStore.record_outcomes``). A shadow copy counts for its own version, never for the primary's.
2. **Comparisons.** A shadow copy (arm ``shadow``) and the job it mirrors (``shadow_of``) are compared once both are
   terminal: whichever of the two settles second finds the other terminal (each side reads its partner after its
   own write, so at least one of them sees both), ``claim_comparison`` lets exactly one compare, and the score
   (``fleet.lifecycle.compare.agreement`` under the model's runtime measure) is recorded for the shadow's version
   (``record_agreement``) and listed (``add_comparison``: both outputs' digests, never the outputs). A side that did
   not succeed gives no score; the entry says which.

No I/O on the settle path: ``on_settled`` only queues, and one background task per worker (started when there is
work, ended when the queue is empty) writes a batch's outcomes in one pipelined call and reads the partners of its
jobs in one ``get_many``. So a job's ack never waits for these writes, and a Redis that fails loses only these
statistics (logged once per outage, never raised); the queue is capped at ``MAX_PENDING`` (beyond it, counts are
dropped and logged). A worker that stops may drop the counts of its last moments: statistics, never a job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleet import constants as c
from fleet.consumers.requests import Job
from fleet.errors import FleetError
from fleet.lifecycle.compare import agreement
from fleet.schemas.jobs import JobRecord, JobState, input_digest
from fleet.store.base import ResultStore
from fleet.store.rollouts import ComparisonEntry, Outcome, RolloutStore

log = logging.getLogger(__name__)

MAX_PENDING = 10_000
RuntimeOf = Callable[[str, str | None], str | None]
"""The runtime whose agreement measure compares a model version's outputs (None: exact equality)."""


def no_runtime(model: str, version: str | None) -> str | None:
    return None


@dataclass(frozen=True, slots=True)
class _Settled:
    record: JobRecord
    submitted_at: float | None
    won: bool


def partner_of(record: JobRecord) -> tuple[str, str] | None:
    """(primary job id, shadow job id) of a record that is one side of a shadow pair, or may be (a primary or canary
    job: its shadow exists only when the policy mirrored it); None for a job outside any policy."""
    if record.arm == "shadow" and record.shadow_of is not None:
        return record.shadow_of, record.job_id
    if record.arm in ("primary", "canary"):
        return record.job_id, record.job_id + c.SHADOW_JOB_SUFFIX
    return None


def outcome_of(record: JobRecord, submitted_at: float | None) -> Outcome | None:
    """The outcome a terminal record counts for its version (None: no version, or no verdict on it)."""
    if record.version is None or record.state not in (JobState.succeeded, JobState.failed):
        return None
    end = record.finished_at or time.time()
    latency_ms = max(0.0, (end - submitted_at) * 1000) if submitted_at is not None else None
    return Outcome(record.model, record.version, record.state == JobState.succeeded, latency_ms)


def compare(primary: JobRecord, shadow: JobRecord, runtime: str | None) -> ComparisonEntry:
    """The comparison of a terminal shadow record with the terminal record it mirrors."""
    score, note = None, None
    if primary.state != JobState.succeeded or shadow.state != JobState.succeeded:
        note = f"not compared: the primary {primary.state.value}, the shadow {shadow.state.value}"
    else:
        try:
            score = agreement(runtime, _as_dict(primary.output), _as_dict(shadow.output))
        except ValueError as exc:
            note = f"not comparable under {runtime or 'exact'}: {exc}"
    return ComparisonEntry(
        at=time.time(),
        model=primary.model,
        job_id=primary.job_id,
        shadow_job_id=shadow.job_id,
        version=primary.version,
        shadow_version=shadow.version,
        runtime=runtime,
        output_digest=_digest(primary.output),
        shadow_output_digest=_digest(shadow.output),
        score=score,
        note=note,
    )


def _as_dict(output: Any) -> dict[str, Any]:
    if not isinstance(output, dict):
        raise ValueError(f"the output is a {type(output).__name__}, not an object")
    return output


def _digest(output: Any) -> str | None:
    if output is None:
        return None
    try:
        return input_digest(output)
    except (ValueError, RecursionError):
        return None


class VersionOutcomes:
    """The hook (``on_settled``) and its background writer; see the module docstring."""

    def __init__(self, store: ResultStore, rollouts: RolloutStore, runtime_of: RuntimeOf = no_runtime) -> None:
        self.store, self.rollouts, self.runtime_of = store, rollouts, runtime_of
        self._pending: list[_Settled] = []
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self._dropped = 0

    async def on_settled(self, job: Job, record: JobRecord, won: bool) -> None:
        """Queue a terminal record that names a version or belongs to a shadow pair; never awaits anything."""
        if record.version is None and partner_of(record) is None:
            return
        if len(self._pending) >= MAX_PENDING:
            self._dropped += 1
            if self._dropped == 1:
                log.warning("version outcomes: %d pending, dropping counts until the writer catches up", MAX_PENDING)
            return
        submitted_at = job.request.submitted_at if job.request is not None else None
        self._pending.append(_Settled(record, submitted_at, won))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._write_all(), name="version-outcomes")

    async def drain(self) -> None:
        """Wait until everything queued so far is written (tests; a worker's shutdown)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def _write_all(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            self._dropped = 0
            try:
                await self._write(batch)
            except FleetError as exc:
                if not self._failing:
                    log.warning("version outcomes: %d not recorded (%s); later ones are tried", len(batch), exc.message)
                self._failing = True
                continue
            except Exception:
                log.exception("version outcomes: %d not recorded", len(batch))
                continue
            if self._failing:
                log.info("version outcomes: recorded again")
            self._failing = False

    async def _write(self, batch: list[_Settled]) -> None:
        outcomes = [o for s in batch if s.won and (o := outcome_of(s.record, s.submitted_at)) is not None]
        if outcomes:
            await self.rollouts.record_outcomes(outcomes)
        await self._compare(batch)

    async def _compare(self, batch: list[_Settled]) -> None:
        pairs = {}
        for settled in batch:
            pair = partner_of(settled.record)
            if pair is not None:
                pairs[pair] = settled.record
        if not pairs:
            return
        partners = {}
        wanted = [other for (primary, shadow), record in pairs.items() for other in (primary, shadow)]
        for job_id, found in zip(wanted, await self.store.get_many(wanted), strict=True):
            if found is not None:
                partners[job_id] = found
        for primary_id, shadow_id in pairs:
            primary, shadow = partners.get(primary_id), partners.get(shadow_id)
            if primary is None or shadow is None or not (primary.terminal and shadow.terminal):
                continue
            if await self.rollouts.claim_comparison(primary.model, primary_id):
                await self._record(primary, shadow)

    async def _record(self, primary: JobRecord, shadow: JobRecord) -> None:
        entry = compare(primary, shadow, self.runtime_of(shadow.model, shadow.version))
        if entry.score is not None and shadow.version is not None:
            await self.rollouts.record_agreement(shadow.model, shadow.version, entry.score)
        await self.rollouts.add_comparison(entry)
