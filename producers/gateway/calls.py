"""Calls into the broker and the store, each bounded by a timeout so a hung dependency cannot hang a request.

A failure becomes ``BrokerUnavailable`` or ``StoreError`` with a message naming the dependency; the error handlers
turn those into ``503`` answers with ``Retry-After``. Waiters are the exception: a client holding a WebSocket, an
event stream or a long-poll waits out a store outage (``patiently``, ``long_poll``) and gets the terminal record
once the store is back; only a long-poll whose own deadline passes with the record unreadable answers ``503``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from fleet import constants as c
from fleet import tenancy, tracing
from fleet.brokers.base import Broker
from fleet.errors import BrokerUnavailable, JobNotFound, QueueFull, StoreError
from fleet.producers.gateway.limits import GatewayLimits
from fleet.schemas.jobs import JobRecord
from fleet.schemas.wire import to_priority
from fleet.store.base import ResultStore

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_FIRST_S = 0.1  # a waiter's first pause after a store call failed
RETRY_MAX_S = 2.0  # and its longest


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


@dataclass(frozen=True, slots=True)
class Bounded:
    """The result store with each call bounded by ``timeout_s``: ``await bounded(store.get(job_id))`` is
    ``store_call(store, store.get(job_id), timeout_s)``. A call that itself waits (``store.wait(id, s)``) passes the
    time it waits as ``waits_s``, added to the bound. ``GatewayState.bounded`` is the request handlers' one."""

    store: ResultStore
    timeout_s: float

    async def __call__(self, call: Awaitable[T], waits_s: float = 0.0) -> T:
        return await store_call(self.store, call, self.timeout_s + waits_s)


async def read_job(
    store: ResultStore, job_id: str, timeout_s: float, viewer: str | None = tenancy.ALL_TENANTS
) -> JobRecord:
    """The job's record, read with ``store_call``.

    Raises:
        JobNotFound: no such job (never submitted, or its record expired), or one of a tenant other than
            ``viewer`` (``fleet.tenancy.visible``): the same 404 either way.
        StoreError: as ``store_call``.
    """
    record = await store_call(store, store.get(job_id), timeout_s)
    if record is None or not tenancy.readable(record, viewer):
        raise JobNotFound(job_id)
    return record


async def patiently(call: Callable[[], Awaitable[T]], job_id: str, deadline: float | None = None) -> T:
    """``call()`` until it does not raise a retriable ``StoreError``, pausing with backoff in between.

    Args:
        call: makes a fresh awaitable per attempt (e.g. a ``store_call``).
        job_id: for the log.
        deadline: ``loop.time()`` after which the last failure is raised; None: retry as long as it takes (the
            caller is cancelled when its client leaves).

    Raises:
        StoreError: not retriable (a corrupt record, a closed store), or still failing at ``deadline``.
    """
    loop = asyncio.get_running_loop()
    pause_s = RETRY_FIRST_S
    failures = 0
    while True:
        try:
            result = await call()
        except StoreError as exc:
            now = loop.time()
            if not exc.retriable or (deadline is not None and now >= deadline):
                raise
            failures += 1
            if failures == 1:
                logger.info("waiter of job %s waits for the store: %s", job_id, exc.message)
            await asyncio.sleep(pause_s if deadline is None else min(pause_s, deadline - now))
            pause_s = min(pause_s * 2, RETRY_MAX_S)
            continue
        if failures:
            logger.info("waiter of job %s reads the store again after %d failed attempts", job_id, failures)
        return result


async def long_poll(
    store: ResultStore, job_id: str, wait_s: float, timeout_s: float, viewer: str | None = tenancy.ALL_TENANTS
) -> JobRecord:
    """``GET /v1/jobs/{id}?wait=S``: the terminal record as soon as it exists, else the current one after ``wait_s``.

    A store outage inside ``wait_s`` is waited out, also one that began before the request.

    Raises:
        JobNotFound: no such job (known as soon as the record can be read), one of a tenant other than ``viewer``
            (known from the first read, before any wait), or it expired while waited for.
        StoreError: the record could not be read at the deadline: a 503 with Retry-After.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    record = await patiently(lambda: store_call(store, store.get(job_id), timeout_s), job_id, deadline)
    if record is None or not tenancy.readable(record, viewer):
        raise JobNotFound(job_id)
    remaining_s = deadline - loop.time()
    if record.terminal or remaining_s <= 0:
        return record
    latest = await store_call(store, store.wait(job_id, remaining_s), remaining_s + timeout_s)
    if latest is None:  # the record expired while we waited
        raise JobNotFound(job_id)
    return latest


def message_priority(data: bytes) -> str:
    """The priority level of a stored request message (``normal`` when it has none or cannot be read)."""
    try:
        body = json.loads(data)
        return to_priority(body.get("priority", c.DEFAULT_PRIORITY) if isinstance(body, dict) else None)
    except ValueError:
        return c.DEFAULT_PRIORITY


async def publish_request(
    broker: Broker,
    model: str,
    job_id: str,
    data: bytes,
    limits: GatewayLimits,
    msg_id: str | None = None,
    priority: str = c.DEFAULT_PRIORITY,
    version: str | None = None,
) -> None:
    """Publish one request message to the subject of its ``priority`` and wait for the broker's acknowledgement.

    The job id is the message id (unless ``msg_id`` is given: a redrive is a new message of the same job), so the
    broker drops a repeated publish inside its de-duplication window. ``version``: the model version the message
    names (header ``fleet-version``), so a dispatcher routes it without parsing the body.

    Raises:
        QueueFull: the broker refused the message for its per-subject limit (nothing was stored).
        BrokerUnavailable: no acknowledgement within ``limits.publish_timeout_s``, or the publish raised. Any
            failure counts: the gateway must not claim a job is queued unless the broker confirmed it.
    """
    headers = {c.HEADER_JOB_ID: job_id, c.HEADER_MODEL: model}
    if version is not None:
        headers[c.HEADER_VERSION] = version
    timeout_s = limits.publish_timeout_s
    traced = tracing.active()
    try:
        async with asyncio.timeout(timeout_s):
            subject = c.request_subject(model, priority)
            if traced is None:
                await broker.publish(subject, data, msg_id=msg_id or job_id, headers=headers)
            else:  # a PRODUCER span whose context the message carries (traceparent / tracestate headers)
                with traced.publish(broker.scheme, subject, job_id, model, headers, version=version):
                    await broker.publish(subject, data, msg_id=msg_id or job_id, headers=headers)
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
