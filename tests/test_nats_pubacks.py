"""``PubAcks`` (JetStream publishes matched to their PubAck through one reply subscription) against a real
nats-server: every publish gets its own answer, duplicates are reported, and each way a PubAck can fail (no
stream, no answer in time, an answer that is not a PubAck, the connection closing) ends that publish with the
nats-py exception the broker maps, while the others go on. Responders that misbehave are plain core-NATS
subscribers on the subject, which the server lets answer in place of a stream.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from fleet.brokers import make_broker
from fleet.brokers.nats import NatsBroker
from fleet.brokers.nats_pubacks import PubAcks
from fleet.errors import PublishFailed
from fleet.settings import FleetSettings
from tests.aof_redis import restartable
from tests.contract.conftest import broker_settings

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    client = await nats.connect(nats_url)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def stream_subject(nc: NATS) -> AsyncIterator[str]:
    token = uuid.uuid4().hex[:8]
    js = nc.jetstream()
    await js.add_stream(name=f"PUBACKS_{token}", subjects=[f"pubacks.{token}"])
    try:
        yield f"pubacks.{token}"
    finally:
        await js.delete_stream(f"PUBACKS_{token}")


async def responder(nc: NATS, subject: str, answer: bytes | None, delay_s: float = 0.0) -> None:
    """A core subscriber on ``subject`` that answers ``answer`` after ``delay_s`` (None: never answers)."""

    async def reply(msg: Msg) -> None:
        if answer is None:
            return
        await asyncio.sleep(delay_s)
        await nc.publish(msg.reply, answer)

    await nc.subscribe(subject, cb=reply)
    await nc.flush()


async def test_each_of_many_concurrent_publishes_gets_its_own_pub_ack(nc: NATS, stream_subject: str) -> None:
    acks = PubAcks(nc)
    ids = [uuid.uuid4().hex for _ in range(500)]

    async def publish(i: int) -> bool:
        return await acks.publish(stream_subject, b"m%d" % i, headers={"Nats-Msg-Id": ids[i]}, timeout_s=10)

    first = await asyncio.gather(*(publish(i) for i in range(500)))
    again = await asyncio.gather(*(publish(i) for i in range(500)))
    assert first == [False] * 500, "a new message id must not be a duplicate"
    assert again == [True] * 500, "the same message ids again must all be duplicates"
    info = await nc.jetstream().stream_info(f"PUBACKS_{stream_subject.split('.')[1]}")
    assert info.state.messages == 500
    assert acks._waiting == {}, "every answered publish must be forgotten"
    await acks.close()


async def test_a_subject_no_stream_stores_is_no_stream_response(nc: NATS) -> None:
    acks = PubAcks(nc)
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        await acks.publish(f"nostream.{uuid.uuid4().hex}", b"x", headers=None, timeout_s=5)
    await acks.close()


async def test_no_answer_in_time_is_a_timeout_and_the_late_answer_is_ignored(nc: NATS, stream_subject: str) -> None:
    slow = f"slow.{uuid.uuid4().hex}"
    await responder(nc, slow, b'{"stream": "S", "seq": 1}', delay_s=0.6)
    acks = PubAcks(nc)
    started = time.monotonic()
    with pytest.raises(nats.errors.TimeoutError):
        await acks.publish(slow, b"x", headers=None, timeout_s=0.2)
    assert time.monotonic() - started < 0.5, "the timeout must end the publish, not the answer"
    await asyncio.sleep(0.8)  # the late answer arrives and finds nothing waiting
    assert await acks.publish(stream_subject, b"after", headers=None, timeout_s=5) is False
    assert acks._waiting == {}
    await acks.close()


@pytest.mark.parametrize(
    ("answer", "err_code"),
    [
        (b"not json", None),
        (b"[1, 2]", None),
        (b'{"error": "no code"}', None),
        (b'{"error": {"code": 400, "err_code": 10077, "description": "maximum messages per subject exceeded"}}', 10077),
        (b'{"error": {"code": 503, "description": "JetStream not enabled"}}', None),
        (b"[" * 100_000, None),  # nested past any parser's limit
        (b'{"error": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", None),
        (b"\xff\xfe not utf-8", None),
    ],
)
async def test_an_answer_that_is_not_a_pub_ack_is_an_api_error(nc: NATS, answer: bytes, err_code: int | None) -> None:
    subject = f"odd.{uuid.uuid4().hex}"
    await responder(nc, subject, answer)
    acks = PubAcks(nc)
    with pytest.raises(nats.js.errors.APIError) as raised:
        await acks.publish(subject, b"x", headers=None, timeout_s=5)
    assert raised.value.err_code == err_code
    await acks.close()


async def waiting_on_silence(nc: NATS) -> tuple[PubAcks, asyncio.Task[bool], str]:
    """A publish to a subject whose only responder never answers, 0.2 s into its wait (timeout 30 s)."""
    silent = f"silent.{uuid.uuid4().hex}"
    await responder(nc, silent, None)
    acks = PubAcks(nc)
    waiting = asyncio.create_task(acks.publish(silent, b"x", headers=None, timeout_s=30))
    await asyncio.sleep(0.2)
    return acks, waiting, silent


async def test_close_ends_a_waiting_publish_at_once(nc: NATS) -> None:
    acks, waiting, silent = await waiting_on_silence(nc)
    started = time.monotonic()
    await acks.close()
    with pytest.raises(nats.errors.ConnectionClosedError):
        await waiting
    assert time.monotonic() - started < 1.0
    with pytest.raises(nats.errors.ConnectionClosedError):
        await acks.publish(silent, b"y", headers=None, timeout_s=1)


async def test_a_cancelled_publish_leaves_nothing_waiting(nc: NATS) -> None:
    acks, waiting, _ = await waiting_on_silence(nc)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert acks._waiting == {}
    await acks.close()


async def test_the_broker_says_which_publish_went_unacknowledged(nats_url: str, nc: NATS) -> None:
    silent = f"silent.{uuid.uuid4().hex}"
    await responder(nc, silent, None)
    broker = make_broker(FleetSettings.model_validate(broker_settings(nats_url).model_dump()))
    assert isinstance(broker, NatsBroker)
    await broker.connect()
    broker.request_timeout_s = 0.3
    try:
        with pytest.raises(PublishFailed, match=f"did not acknowledge a publish to {silent} within 0.3s"):
            await broker.publish(silent, b"x", msg_id="m1")
        with pytest.raises(PublishFailed, match="no JetStream stream"):
            await broker.publish(f"nostream.{uuid.uuid4().hex}", b"x")
    finally:
        await broker.close()


@pytest.mark.services
async def test_a_server_killed_mid_publish_times_it_out_and_publishing_works_again_after_the_restart() -> None:
    """The reply subscription is sent again on reconnect: publishes after a restart are matched to their PubAcks."""
    with restartable("nats") as server:  # started
        client = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
        try:
            token = uuid.uuid4().hex[:8]
            await client.jetstream().add_stream(name=f"PUBACKS_{token}", subjects=[f"kill.{token}"])
            acks = PubAcks(client)
            assert await acks.publish(f"kill.{token}", b"before", headers=None, timeout_s=5) is False
            silent = f"silent.{token}"
            await responder(client, silent, None)
            waiting = asyncio.create_task(acks.publish(silent, b"x", headers=None, timeout_s=1.0))
            await asyncio.sleep(0.2)
            server.kill()
            with pytest.raises(nats.errors.TimeoutError):  # its answer went with the old connection
                await waiting
            server.start()
            deadline = time.monotonic() + 20
            timed_out = False  # a try that timed out may have been stored all the same: then the next is a duplicate
            while True:
                try:
                    duplicate = await acks.publish(
                        f"kill.{token}", b"after", headers={"Nats-Msg-Id": "after"}, timeout_s=1.0
                    )
                    break
                except nats.errors.TimeoutError:
                    timed_out = True
                    assert time.monotonic() < deadline, "no PubAck within 20 s of the restart"
                    await asyncio.sleep(0.2)
                except nats.errors.Error:
                    assert time.monotonic() < deadline, "no PubAck within 20 s of the restart"
                    await asyncio.sleep(0.2)
            assert duplicate is False or timed_out, "a first PubAck for 'after' says it is new"
            info = await client.jetstream().stream_info(f"PUBACKS_{token}")
            assert info.state.messages == 2  # the file store kept "before"; "after" is new
            assert acks._waiting == {}
            await acks.close()
        finally:
            await client.close()
