"""Redrive and purge of recorded dead letters (``POST /v1/deadletters/redrive`` and ``/purge``).

A redrive takes the letters out of the store first (``DeadLetterStore.take``: two operators redriving one letter
redrive it once), then, for each, makes its job a fresh attempt: the job's record is replaced by a new ``queued``
one with no runs counted (``deliveries`` 0, so the worker's ``max_deliveries`` cap starts again), written with its
request message marked unpublished (as a submit does, so a gateway that dies here leaves it to a reconcile sweep),
the request is published under a new message id (``<job>.redrive.<random>``: the broker's de-duplication window
would drop a second publish under the job id) and the mark is cleared. The job then runs again and ends once.

Not redrivable (the letter goes back to the store, with the reason in the answer): a letter holding raw bytes
instead of a request, a request that no longer parses, a model this gateway does not serve, and a DAG step (its run
already ended failed; start the run again instead). A publish that fails puts the letter back and removes the
queued record, so nothing claims a job that is not queued.
"""

from __future__ import annotations

import logging
import time
import uuid

from pydantic import ValidationError

from fleet.producers.gateway.calls import publish_request
from fleet.producers.gateway.state import GatewayState
from fleet.schemas.jobs import JobRecord, JobState, input_digest
from fleet.schemas.operator import LetterSelection, PurgeResult, RedriveResult
from fleet.schemas.wire import RequestMessage
from fleet.store.deadletters import DeadLetterStore, StoredLetter

log = logging.getLogger(__name__)

ALL_LIMIT = 10_000  # letters one "all" selection reaches


async def selected_ids(letters: DeadLetterStore, selection: LetterSelection) -> list[str]:
    if selection.letter_ids is not None:
        return list(dict.fromkeys(selection.letter_ids))
    assert selection.model is not None  # the body's validator insists
    return await letters.ids(selection.model, ALL_LIMIT)


def _why_not(state: GatewayState, stored: StoredLetter) -> tuple[RequestMessage | None, str | None]:
    """The request to publish again, or why this letter cannot be redriven."""
    letter = stored.letter
    if letter.request is None:
        return None, "the letter holds the raw message, not a request (it never parsed); purge it"
    try:
        request = RequestMessage.model_validate(letter.request)
    except ValidationError as exc:
        return None, f"the letter's request is not a valid request message: {exc.error_count()} error(s)"
    if request.model not in state.specs:
        return None, f"model {request.model!r} is not served by this gateway"
    if request.dag is not None:
        return None, f"a step of DAG run {request.dag.run!r}, which ended failed: start the run again instead"
    return request, None


async def requeue(state: GatewayState, request: RequestMessage) -> None:
    """Replace the job's record with a fresh queued attempt and publish its request under a new message id."""
    now = time.time()
    fresh = request.model_copy(update={"submitted_at": now, "deadline": None})
    data = fresh.model_dump_json().encode()
    record = JobRecord(
        job_id=request.job_id,
        model=request.model,
        state=JobState.queued,
        created_at=now,
        deliveries=0,
        input_digest=input_digest(request.input),
        version=request.version,
        arm=request.arm,
        shadow_of=request.shadow_of,
    )
    store, bounded = state.store, state.bounded
    await bounded(store.delete(request.job_id))
    await bounded(store.create(record, data))
    msg_id = f"{request.job_id}.redrive.{uuid.uuid4().hex[:12]}"
    try:
        limits, priority = state.limits, request.priority
        await publish_request(
            state.broker,
            request.model,
            request.job_id,
            data,
            limits,
            msg_id=msg_id,
            priority=priority,
            version=request.version,
        )
    except BaseException:
        await bounded(store.delete(request.job_id))
        raise
    try:
        await bounded(store.published(request.job_id))
    except Exception as exc:  # the broker has it; a sweep clears the mark (its republish is answered by the record)
        log.warning("redriven job %s is published but still marked unpublished: %s", request.job_id, exc)


async def redrive(state: GatewayState, letters: DeadLetterStore, selection: LetterSelection) -> RedriveResult:
    ids = await selected_ids(letters, selection)
    taken = await letters.take(ids)
    result = RedriveResult(redriven=[], missing=[i for i in ids if i not in {s.letter_id for s in taken}])
    for n, stored in enumerate(taken):
        request, reason = _why_not(state, stored)
        if request is None:
            result.not_redrivable[stored.letter_id] = reason or "not redrivable"
            await letters.put_back([stored])
            continue
        try:
            await requeue(state, request)
        except BaseException:
            await letters.put_back(taken[n:])
            raise
        log.info("dead letter %s redriven: job %s queued again", stored.letter_id, request.job_id)
        result.redriven.append(stored.letter_id)
    return result


async def purge(letters: DeadLetterStore, selection: LetterSelection) -> PurgeResult:
    ids = await selected_ids(letters, selection)
    taken = {s.letter_id for s in await letters.take(ids)}
    return PurgeResult(purged=[i for i in ids if i in taken], missing=[i for i in ids if i not in taken])
