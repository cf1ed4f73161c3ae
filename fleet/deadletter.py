"""Dead letters: what a worker or a dispatcher publishes on ``fleet.dlq.<model>`` when it gives up on a message.

Both build the letter here so that it is the same object whoever sends it, and so that building it never raises:
a request that cannot be serialised again (nested past the serialiser's limit, say) is sent as its raw bytes.
"""

from __future__ import annotations

import logging
from typing import Any

from fleet import constants as c
from fleet.brokers.base import Broker
from fleet.schemas.jobs import JobError
from fleet.schemas.wire import DeadLetter

log = logging.getLogger(__name__)

RAW_LIMIT_CHARS = 65536  # of a body that is not a valid request, this much travels in the letter


def raw_text(data: bytes) -> str:
    return data.decode("utf-8", "replace")[:RAW_LIMIT_CHARS]


def dead_letter_bytes(
    *,
    job_id: str | None,
    model: str,
    error: JobError,
    deliveries: int,
    sender: str,
    request: dict[str, Any] | None,
    data: bytes,
) -> bytes:
    """The letter as JSON: the request when there is one that serialises, else the raw body."""
    fields = {"job_id": job_id, "model": model, "error": error, "deliveries": deliveries, "worker_id": sender}
    if request is not None:
        try:
            return DeadLetter(**fields, request=request).model_dump_json().encode()
        except Exception as exc:  # e.g. too deep to serialise: the raw body says the same
            log.debug("dead letter of %s: request does not serialise (%s); sending the raw body", job_id, exc)
    return DeadLetter(**fields, raw=raw_text(data)).model_dump_json().encode()


async def publish_dead_letter(
    broker: Broker,
    model: str,
    job_id: str | None,
    error: JobError,
    letter: bytes,
    request_msg_id: str | None = None,
) -> None:
    """Publish a letter; a repeat for the same request message is de-duplicated by the broker. Raises
    ``BrokerError``. The letter's message id follows the request's (``<job>.dlq`` for a first submission), so a
    job redriven by an operator (a new request message id) that fails again gets a letter of its own."""
    headers = {c.HEADER_ERROR: error.type, c.HEADER_MODEL: model}
    if job_id:
        headers[c.HEADER_JOB_ID] = job_id
    msg_id = f"{request_msg_id or job_id}.dlq" if job_id else None
    await broker.publish(c.dlq_subject(model), letter, msg_id=msg_id, headers=headers)
