"""Calls into the broker and the store, each bounded by a timeout so a hung dependency cannot hang a request.

A failure becomes ``BrokerUnavailable`` or ``StoreError`` with a message naming the dependency; the error handlers
turn those into ``503`` answers with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from fleet import constants as c
from fleet.brokers.base import Broker
from fleet.errors import BrokerUnavailable, JobNotFound, QueueFull, StoreError
from fleet.store.base import ResultStore
from producers.gateway.limits import GatewayLimits
from schemas.jobs import JobRecord

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def store_call(store: ResultStore, call: Awaitable[T], timeout_s: float) -> T:
    """Await one store operation for at most ``timeout_s``.

    Raises:
        StoreError: the store raised it, timed out, or the connection failed (OSError).
    """
    try:
        async with asyncio.timeout(timeout_s):
            return await call
    except StoreError:
        raise
    except TimeoutError as exc:
        raise StoreError(f"the result store ({store.scheme}) did not answer within {timeout_s:g}s") from exc
    except OSError as exc:
        raise StoreError(f"the result store ({store.scheme}) cannot be reached: {exc}") from exc


async def read_job(store: ResultStore, job_id: str, timeout_s: float) -> JobRecord:
    """The job's record, read with ``store_call``.

    Raises:
        JobNotFound: no such job (never submitted, or its record expired): a 404.
        StoreError: as ``store_call``.
    """
    record = await store_call(store, store.get(job_id), timeout_s)
    if record is None:
        raise JobNotFound(job_id)
    return record


async def publish_request(broker: Broker, model: str, job_id: str, data: bytes, limits: GatewayLimits) -> None:
    """Publish one request message and wait for the broker's acknowledgement.

    The job id is the message id, so the broker drops a repeated publish inside its de-duplication window.

    Raises:
        QueueFull: the broker refused the message for its per-subject limit (nothing was stored).
        BrokerUnavailable: no acknowledgement within ``limits.publish_timeout_s``, or the publish raised. Any
            failure counts: the gateway must not claim a job is queued unless the broker confirmed it.
    """
    headers = {c.HEADER_JOB_ID: job_id, c.HEADER_MODEL: model}
    timeout_s = limits.publish_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            await broker.publish(c.request_subject(model), data, msg_id=job_id, headers=headers)
    except QueueFull:
        raise
    except TimeoutError as exc:
        logger.warning("publish of job %s to %s timed out after %gs", job_id, broker.scheme, timeout_s)
        raise BrokerUnavailable(
            f"the broker ({broker.scheme}) did not acknowledge the job within {timeout_s:g}s"
        ) from exc
    except Exception as exc:
        logger.warning("publish of job %s to %s failed: %s", job_id, broker.scheme, exc)
        detail = getattr(exc, "message", None) or str(exc) or type(exc).__name__
        raise BrokerUnavailable(f"the broker ({broker.scheme}) did not accept the job: {detail}") from exc
