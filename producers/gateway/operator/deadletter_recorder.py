"""The dead-letter recorder: reads ``fleet.dlq.<model>`` for every served model and stores each letter.

Every gateway runs one, all in the consumer group ``DEAD_LETTER_GROUP``, so a letter is taken by one of them at a
time. A letter is stored (idempotently, by letter id) and only then acked; a store that cannot be reached hands it
back to be delivered again. A body that is not a ``DeadLetter`` is kept as one with its raw text and the error
``unreadable_letter``, so it can be seen and purged.

A letter's id is a digest of its message id (``<request msg id>.dlq``, the same for a resent letter of the same
failure) or, without one, of its bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging

from pydantic import ValidationError

from fleet import constants as c
from fleet.brokers.base import Broker, Delivery, Subscription
from fleet.deadletter import raw_text
from fleet.schemas.jobs import JobError
from fleet.schemas.wire import DeadLetter
from fleet.store.deadletters import DeadLetterStore
from fleet.tasks import cancel_and_wait

log = logging.getLogger(__name__)

FETCH_BATCH = 64
FETCH_TIMEOUT_S = 1.0
RETRY_DELAY_S = 2.0


def letter_id(delivery: Delivery) -> str:
    basis = f"msg:{delivery.msg_id}".encode() if delivery.msg_id else delivery.data
    return hashlib.sha256(basis).hexdigest()[:24]


def parse_letter(model: str, delivery: Delivery) -> DeadLetter:
    """The letter in ``delivery``; a body that is not one becomes an ``unreadable_letter`` holding its text."""
    try:
        return DeadLetter.model_validate_json(delivery.data)
    except (ValidationError, ValueError) as exc:
        return DeadLetter(
            job_id=delivery.headers.get(c.HEADER_JOB_ID),
            model=model,
            error=JobError(type="unreadable_letter", message=f"the dead letter is not readable: {exc}"[:500]),
            deliveries=0,
            worker_id="unknown",
            raw=raw_text(delivery.data),
        )


class DeadLetterRecorder:
    """``async with DeadLetterRecorder(broker, letters, models)`` records until the block ends."""

    def __init__(self, broker: Broker, letters: DeadLetterStore, models: list[str]) -> None:
        self.broker = broker
        self.letters = letters
        self.models = models
        self.recorded = 0
        self._subs: list[Subscription] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> DeadLetterRecorder:
        for model in self.models:
            sub = await self.broker.subscribe(c.dlq_subject(model), c.DEAD_LETTER_GROUP)
            self._subs.append(sub)
            self._tasks.append(asyncio.create_task(self._run(model, sub), name=f"dlq-recorder-{model}"))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await cancel_and_wait(self._tasks)
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.close()
        self._tasks, self._subs = [], []

    async def _run(self, model: str, sub: Subscription) -> None:
        while True:
            try:
                batch = await sub.fetch(FETCH_BATCH, FETCH_TIMEOUT_S)
                for delivery in batch:
                    await self._record(model, delivery)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("dead-letter recorder of %s: %s; retrying in %.0fs", model, exc, RETRY_DELAY_S)
                await asyncio.sleep(RETRY_DELAY_S)

    async def _record(self, model: str, delivery: Delivery) -> None:
        letter = parse_letter(model, delivery)
        try:
            await self.letters.add(letter_id(delivery), letter)
        except Exception as exc:
            log.warning("dead letter of %s not stored (%s); it comes back later", letter.job_id, exc)
            await delivery.nak(RETRY_DELAY_S)
            return
        self.recorded += 1
        await delivery.ack()
