"""Starting runs without the gateway: a message on ``fleet.req._dagrun`` starts a run of a registered DAG.

Body: one JSON object ``{"dag": NAME, "input": {...}, "run_id"?: ID, "version"?: N, "timeout_s"?: SECONDS,
"tenant"?: TENANT}`` (``DagStartMessage``): the tenant's DAG ``NAME`` (its latest version, or ``version``) runs as
that tenant's run ``ID``.
Every ``fleet worker`` and ``fleet up`` process runs one ``DagStarter``; they compete for these messages like a
model's workers for its requests. The run id, when not given, is derived from the message id (NATS ``Nats-Msg-Id``,
the Kafka key) or else from the body, so a redelivered start starts the same run (``DagRunner.start`` is idempotent
on the run id). A message that cannot start a run (not JSON, unknown DAG, input that does not match the DAG) is
dead-lettered on ``fleet.dlq._dagrun`` with the reason; an outage of the store or broker hands it back.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

from pydantic import ValidationError

from fleet import constants as c
from fleet.brokers.base import Delivery, Subscription
from fleet.dags.runner import DagRunner
from fleet.deadletter import dead_letter_bytes, publish_dead_letter
from fleet.errors import BrokerError, FleetError, StoreError
from fleet.schemas.jobs import JobError
from fleet.schemas.wire import DagStartMessage
from fleet.tasks import cancel_and_wait

log = logging.getLogger(__name__)

DAG_START_GROUP = "fleet-dagrun"
DAG_START_DLQ_MODEL = "_dagrun"  # its dead letters go to fleet.dlq._dagrun
FETCH_TIMEOUT_S = 1.0
RETRY_DELAY_S = 1.0


def run_id_for(delivery: Delivery, given: str | None) -> str:
    if given:
        return given
    basis = delivery.msg_id.encode() if delivery.msg_id else delivery.data
    return "m" + hashlib.sha256(basis).hexdigest()[:40]


class DagStarter:
    """Consumes ``fleet.req._dagrun`` and starts the runs it asks for. ``start``/``stop``."""

    def __init__(self, runner: DagRunner, owner: str) -> None:
        self.runner = runner
        self.owner = owner
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        self.started = 0

    async def start(self) -> None:
        self._sub = await self.runner.broker.subscribe(c.DAG_START_SUBJECT, DAG_START_GROUP)
        self._task = asyncio.create_task(self._loop(), name=f"{self.owner}-dag-starter")

    async def stop(self) -> None:
        """Idempotent; never raises: a subscription that cannot leave its group cleanly (the broker is down) is
        closed all the same, and its unsettled starts are redelivered to another starter."""
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.close()
            except Exception as exc:
                log.warning(
                    "%s: closing the DAG start subscription failed (%r); it is closed all the same", self.owner, exc
                )

    async def _loop(self) -> None:
        assert self._sub is not None
        while True:
            try:
                batch = await self._sub.fetch(16, FETCH_TIMEOUT_S)
            except BrokerError as exc:
                log.warning("%s: fetching DAG starts failed (%s); retrying", self.owner, exc)
                await asyncio.sleep(RETRY_DELAY_S)
                continue
            for delivery in batch:
                await self._handle(delivery)

    async def _handle(self, delivery: Delivery) -> None:
        try:
            message = DagStartMessage.model_validate_json(delivery.data)
        except ValidationError as exc:
            await self._reject(delivery, f"not a DAG start message: {exc.errors()[0]['msg']}")
            return
        except Exception as exc:  # whatever the body does to the parser, it is one bad message
            await self._reject(delivery, f"not a DAG start message ({type(exc).__name__})")
            return
        try:
            run_id = run_id_for(delivery, message.run_id)
            await self.runner.start(
                message.dag, message.input, run_id, message.timeout_s, message.tenant, message.version
            )
        except (StoreError, BrokerError) as exc:
            log.warning("%s: could not start a run of %s (%s); handing it back", self.owner, message.dag, exc)
            await _quietly(delivery.nak(RETRY_DELAY_S))
            return
        except FleetError as exc:
            await self._reject(delivery, exc.message)
            return
        self.started += 1
        await _quietly(delivery.ack())

    async def _reject(self, delivery: Delivery, message: str) -> None:
        error = JobError(type="invalid_dag_start", message=message)
        letter = dead_letter_bytes(
            job_id=None,
            model=DAG_START_DLQ_MODEL,
            error=error,
            deliveries=delivery.delivery_count,
            sender=self.owner,
            request=None,
            data=delivery.data,
        )
        log.warning("%s: DAG start dead-lettered: %s", self.owner, message)
        try:
            await publish_dead_letter(self.runner.broker, DAG_START_DLQ_MODEL, None, error, letter)
        except BrokerError:
            await _quietly(delivery.nak(RETRY_DELAY_S))
            return
        await _quietly(delivery.term())


async def _quietly(call: Any) -> None:
    try:
        await call
    except Exception as exc:
        log.warning("settling a DAG start message failed: %s", exc)
