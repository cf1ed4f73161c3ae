"""The job-record state transitions, as pure functions shared by every result store.

A store reads the current record, asks these functions for the next one and writes it with its own atomic
compare-and-set; keeping the rules here means the in-memory store and Redis cannot drift apart.

The records built here are not validated again: every value comes either from a record that was validated when it
was read, or from this module (times, states), or from the caller's typed arguments (``error`` is checked to be a
``JobError``). A worker moves every job through two transitions, so skipping a second validation of values we
produced ourselves is a large share of the store's cost.

``record_json`` serialises with orjson: the record's values as they are (numpy arrays passed through, nested
pydantic models dumped), no validation and no Python wrapper per float. It writes the document
``model_dump_json()`` writes (same fields, order and types; only the spelling of a number may differ) less the
top-level fields that are null, which the parser fills in again (every one of them defaults to null): about 100
bytes less per record. So every reader (``packed.parse_record``, which validates a JSON record with
``JobRecord.model_validate_json``) reads records written before and after, and what it gives back (``model_dump``,
the REST answers) has every field. What orjson cannot write (an integer beyond 64 bits in an output) falls back to
pydantic's serializer. A record whose output holds vectors a worker encoded as base64 is written packed, with the
vectors' bytes after its JSON (``fleet.store.packed``); ``parse_record`` reads both forms.

Ownership (``foreign``): a job id names one job of one model and one tenant. ``start_many`` and ``finish_many`` of
every store leave a record of another model or another tenant exactly as it is and hand it back, so that a message
naming someone else's job id (a raw publish, a guessed id) is never computed into that record; the check is part of
the same compare-and-set step that writes, so no write can slip in between. The caller recognises the foreign
record with the same function and treats the message as a conflict (``fleet.consumers.settle.Settler.conflicts``).
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel

from fleet.constants import DEFAULT_TENANT
from fleet.schemas.construct import built
from fleet.schemas.jobs import TERMINAL_STATES, JobError, JobRecord, JobState, StageTimings
from fleet.store.packed import pack

_SERIALIZER = JobRecord.__pydantic_serializer__
_FIELDS = set(JobRecord.model_fields)
_RUNNING = JobState.running


def trusted(values: dict[str, Any]) -> JobRecord:
    """A record from values of the right types for every field, without validating them again: what
    ``JobRecord.model_construct`` makes, at a quarter of its cost (``fleet.schemas.construct.built``)."""
    return built(JobRecord, values, _FIELDS.copy())


def foreign(current: JobRecord, model: str, tenant: str | None) -> bool:
    """Whether ``current`` belongs to another job than one of ``model`` for ``tenant`` (None: the default tenant):
    two string compares, cheap enough for every transition."""
    return current.model != model or (current.tenant or DEFAULT_TENANT) != (tenant or DEFAULT_TENANT)


def _fresh(job_id: str, model: str, now: float, **fields: Any) -> JobRecord:
    """A record with no earlier one: created now, every field not in ``fields`` empty."""
    values: dict[str, Any] = {
        "job_id": job_id,
        "model": model,
        "state": _RUNNING,
        "output": None,
        "error": None,
        "created_at": now,
        "started_at": None,
        "finished_at": None,
        "deliveries": 0,
        "batch_size": None,
        "strikes": None,
        "worker_id": None,
        "expires_at": None,
        "input_digest": None,
        "cache": None,
        "cache_similarity": None,
        "tenant": None,
        "version": None,
        "arm": None,
        "shadow_of": None,
        "timings": None,
        "device_seconds": None,
        "trace_id": None,
    }
    values.update(fields)
    return trusted(values)


_ORJSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def _orjson_default(value: Any) -> Any:
    if isinstance(value, BaseModel):  # a JobError, or a model object left in an output
        return value.model_dump(mode="json")
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _dumps(values: dict[str, Any]) -> bytes:
    return orjson.dumps(values, default=_orjson_default, option=_ORJSON_OPTIONS)


def record_json(record: JobRecord) -> bytes:
    """The record as stored: UTF-8 JSON bytes (``record.model_dump_json()`` without its null fields, at orjson's
    speed), or, when its output holds vectors Fleet encoded as base64, packed with their bytes (``fleet.store.packed``;
    read either form with ``parse_record``)."""
    try:
        values = {name: value for name, value in record.__dict__.items() if value is not None}
        timings = values.get("timings")
        if timings is not None:  # on every record a worker ends: its floats as they are, not through ``default``
            values["timings"] = timings.__dict__
        if values.get("output").__class__ is dict:  # may hold base64 vectors to pack
            packed = pack(values, _dumps)
            if packed is not None:
                return packed
        return _dumps(values)
    except (orjson.JSONEncodeError, TypeError):
        return _SERIALIZER.to_json(record)  # e.g. an integer past 64 bits: pydantic writes it, or says why not


def started(
    current: JobRecord | None,
    job_id: str,
    *,
    model: str,
    worker_id: str,
    deliveries: int,
    now: float,
    tenant: str | None = None,
    batch_size: int | None = None,
    strikes: int = 0,
    version: str | None = None,
) -> JobRecord:
    """The record after a worker picked the job up; a terminal ``current`` is returned unchanged. ``tenant`` (the
    request message's) is written only into a record created here: an existing record keeps its own.
    ``batch_size`` and ``strikes`` are the run's (``fleet.consumers.crashes``); a record keeps the larger strike
    count. ``version``: the model version the run computes with (None: the record keeps its own)."""
    if current is None:
        return _fresh(
            job_id,
            model,
            now,
            started_at=now,
            deliveries=deliveries,
            worker_id=worker_id,
            tenant=tenant,
            batch_size=batch_size,
            strikes=strikes or None,
            version=version,
        )
    if current.state in TERMINAL_STATES:
        return current
    values = dict(current.__dict__)
    values["state"] = _RUNNING
    if values["started_at"] is None:
        values["started_at"] = now
    values["worker_id"] = worker_id
    values["deliveries"] = deliveries
    values["batch_size"] = batch_size
    values["strikes"] = max(strikes, values.get("strikes") or 0) or None
    if version is not None:
        values["version"] = version
    return trusted(values)


def finished(
    current: JobRecord | None,
    job_id: str,
    state: JobState,
    *,
    model: str,
    output: Any,
    error: JobError | None,
    worker_id: str | None,
    now: float,
    tenant: str | None = None,
    version: str | None = None,
    device_seconds: float | None = None,
    timings: StageTimings | None = None,
    trace_id: str | None = None,
) -> JobRecord:
    """The terminal record that replaces a non-terminal ``current`` (or stands alone when there is none, then of
    ``tenant``); ``version`` names the model version that answered (None: the record keeps its own);
    ``device_seconds`` is the job's share of its batch's compute (None: it did not compute here). ``timings`` (the
    run's stage instants) get ``stored`` = ``now`` and go into the record, as ``trace_id`` does when given."""
    if state.__class__ is not JobState:
        state = JobState(state)
    if state not in TERMINAL_STATES:
        raise ValueError(f"finish() needs a terminal state, got {state.value!r}")
    if error is not None and not isinstance(error, JobError):
        error = JobError.model_validate(error)
    if timings is not None:
        timings.__dict__["stored"] = now  # built by the settler for this write: no validation needed
    if current is None:
        return _fresh(
            job_id,
            model,
            now,
            state=state,
            output=output,
            error=error,
            finished_at=now,
            worker_id=worker_id,
            tenant=tenant,
            version=version,
            device_seconds=device_seconds,
            timings=timings,
            trace_id=trace_id,
        )
    values = dict(current.__dict__)
    values["state"] = state
    values["device_seconds"] = device_seconds
    values["output"] = output
    values["error"] = error
    values["finished_at"] = now
    if worker_id is not None:
        values["worker_id"] = worker_id
    if version is not None:
        values["version"] = version
    if timings is not None:
        values["timings"] = timings
    if trace_id is not None:
        values["trace_id"] = trace_id
    return trusted(values)
