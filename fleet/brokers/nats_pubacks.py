"""JetStream publishes that await their PubAck through one reply subscription per connection.

nats-py's ``JetStreamContext.publish`` is a request: each call makes a reply token and a future, runs the wait
under ``asyncio.wait_for``, and turns the answer into a ``PubAck`` dataclass. On this machine that cost about 30 us
of client CPU a publish, as much as the rest of a worker's delivery work. ``PubAcks`` does the same exchange with
less: one wildcard subscription on ``<inbox>.*`` for the whole connection, a counter for the reply token, one
timer handle per publish, and the answer read with orjson. The server sees exactly what a request sends (a publish
with a reply subject), and the outcomes are nats-py's own exceptions, so callers handle them as before:

* ``nats.errors.TimeoutError``: no PubAck within the timeout (the message may or may not be stored);
* ``nats.js.errors.NoStreamResponseError``: no stream stores the subject (the server answers 503 "no responders");
* ``nats.js.errors.APIError``: JetStream refused the message (``err_code`` says why, e.g. 10077 for a full
  subject), or its answer could not be read;
* ``nats.errors.MaxPayloadError``, ``ConnectionClosedError`` and the like: raised by nats-py's publish itself,
  before anything is sent.

nats-py sends the subscription again after a reconnect. A PubAck lost with the old connection ends its publish
with the timeout, as a request's would. ``close`` ends every waiting publish at once.
"""

from __future__ import annotations

import asyncio
import itertools

import nats.errors
import nats.js.errors
import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

NO_RESPONDERS = "503"  # the status the server answers when nothing (no stream) listens on the subject


class PubAcks:
    """Publishes to JetStream on ``nc``; each awaits its own PubAck (matched by the reply subject's last token)."""

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._prefix = ""
        self._sub: Subscription | None = None
        self._starting = asyncio.Lock()
        self._waiting: dict[str, asyncio.Future[Msg]] = {}
        self._tokens = itertools.count()
        self._closed = False

    async def publish(self, subject: str, data: bytes, *, headers: dict[str, str] | None, timeout_s: float) -> bool:
        """Publish and wait for the PubAck; True when the server dropped the message as a duplicate.

        Raises the nats-py exceptions listed in the module docstring.
        """
        if self._sub is None:
            await self._start()
        token = str(next(self._tokens))
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Msg] = loop.create_future()
        self._waiting[token] = waiter
        timer = loop.call_later(timeout_s, _time_out, waiter)
        try:
            await self._nc.publish(subject, data, reply=self._prefix + token, headers=headers)
            reply = await waiter
        finally:
            timer.cancel()
            self._waiting.pop(token, None)
        return _duplicate(reply)

    async def close(self) -> None:
        """End every waiting publish with ``ConnectionClosedError``. Idempotent. The subscription is left to the
        connection's own close (no round trip to the server on the way out)."""
        self._closed = True
        self._sub = None
        waiting, self._waiting = self._waiting, {}
        for waiter in waiting.values():
            if not waiter.done():
                waiter.set_exception(nats.errors.ConnectionClosedError())

    async def _start(self) -> None:
        async with self._starting:
            if self._closed:
                raise nats.errors.ConnectionClosedError()
            if self._sub is not None:
                return
            prefix = self._nc.new_inbox() + "."
            self._sub = await self._nc.subscribe(prefix + "*", cb=self._on_reply)
            self._prefix = prefix

    async def _on_reply(self, msg: Msg) -> None:
        waiter = self._waiting.get(msg.subject[len(self._prefix) :])
        if waiter is not None and not waiter.done():  # a late answer to a publish that timed out finds nothing
            waiter.set_result(msg)


def _time_out(waiter: asyncio.Future[Msg]) -> None:
    if not waiter.done():
        waiter.set_exception(nats.errors.TimeoutError())


def _duplicate(reply: Msg) -> bool:
    """Whether the PubAck says duplicate; raise for an answer that is not a PubAck."""
    if reply.headers and reply.headers.get("Status") == NO_RESPONDERS:
        raise nats.js.errors.NoStreamResponseError
    try:
        answer = orjson.loads(reply.data)
    except orjson.JSONDecodeError:
        raise nats.js.errors.APIError(description=f"unreadable PubAck {reply.data[:200]!r}") from None
    if not isinstance(answer, dict):
        raise nats.js.errors.APIError(description=f"unreadable PubAck {reply.data[:200]!r}")
    if "error" in answer:
        error = answer["error"]
        try:
            nats.js.errors.APIError.from_error(error)  # raises nats-py's exception for the error's code
        except (KeyError, TypeError):  # not the shape JetStream sends
            raise nats.js.errors.APIError(description=f"unreadable PubAck error {str(error)[:200]}") from None
    return bool(answer.get("duplicate", False))
