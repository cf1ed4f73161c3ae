"""Acked messages that a work-queue stream kept: found and purged.

A work-queue stream deletes a message once its consumer acks it. nats-server 2.9's file store writes those
deletes lazily: after a SIGKILL (or a crash) of the server it can come back with a consumer whose ack floor is
past messages that the stream still holds. The consumer never delivers them again (they are below its ack floor),
so they stay until ``max_age`` (the job TTL, 24 h by default), and each takes a place of the subject's
``max_msgs_per_subject`` bound: a model's queue looks fuller than it is, and a publish can be refused as
``QueueFull`` with room to spare.

``purge_acked`` finds them (the subject holds more messages than its consumer has waiting and in flight) and
purges the subject below the consumer's ack floor (the purge API's ``filter`` and ``seq``): every message there has
been acked, so nothing live is removed. The NATS broker runs it for a work-queue subject when it subscribes to it
and again, for each of its subscriptions, after every reconnection (when JetStream answers again). A subject
that no process subscribes to keeps its leftovers until a worker of it starts.
"""

from __future__ import annotations

import asyncio
import logging

import nats.errors
from nats.js import JetStreamContext

log = logging.getLogger(__name__)

RETRY_S = 1.0  # JetStream may not answer for a while after a restart: try again at this pace
RETRY_FOR_S = 60.0


async def leftovers(js: JetStreamContext, stream: str, durable: str, subject: str) -> tuple[int, int]:
    """``(messages of subject the consumer will not deliver again, its ack floor's stream sequence)``: the first is
    what the subject stores beyond what the consumer has waiting and in flight (an estimate: it may count messages
    acked above the floor too, which the purge leaves)."""
    info = await js.consumer_info(stream, durable)
    floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0
    if not floor:
        return 0, 0
    state = (await js.stream_info(stream, subjects_filter=subject)).state
    if state.first_seq > floor:
        return 0, floor  # nothing at all is stored at or below the floor
    stored = (state.subjects or {}).get(subject, 0)
    live = (info.num_pending or 0) + (info.num_ack_pending or 0)
    return max(stored - live, 0), floor


async def purge_acked(js: JetStreamContext, stream: str, durable: str, subject: str) -> int:
    """Purge the messages of ``subject`` at or below ``durable``'s ack floor when any are left; how many were."""
    suspected, floor = await leftovers(js, stream, durable, subject)
    count = 0
    if suspected:
        before = await _stored(js, stream, subject)
        await js.purge_stream(stream, seq=floor + 1, subject=subject)  # keeps seq floor+1 and above
        count = before - await _stored(js, stream, subject)
    if count > 0:
        log.warning(
            "%s: %d acked messages of %s were still stored (a NATS server restarted without writing their "
            "deletion); purged them below the ack floor %d of %s",
            stream,
            count,
            subject,
            floor,
            durable,
        )
    return max(count, 0)


async def _stored(js: JetStreamContext, stream: str, subject: str) -> int:
    state = (await js.stream_info(stream, subjects_filter=subject)).state
    return (state.subjects or {}).get(subject, 0)


async def purge_acked_until_answered(js: JetStreamContext, stream: str, durable: str, subject: str) -> None:
    """``purge_acked``, tried again while JetStream does not answer (it is recovering), for ``RETRY_FOR_S``."""
    loop = asyncio.get_running_loop()
    until = loop.time() + RETRY_FOR_S
    while True:
        try:
            await purge_acked(js, stream, durable, subject)
            return
        except nats.errors.Error as exc:
            if loop.time() >= until:
                log.warning("%s: acked leftovers of %s not checked (%r)", stream, subject, exc)
                return
        await asyncio.sleep(RETRY_S)
