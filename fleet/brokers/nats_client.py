"""nats-py's client with a faster message-header parser, and messages handed straight to a subscription's function.

nats-py 2.1x parses every header line of every message and rejects header names that hold whitespace by testing
each character in a generator; with the three headers a Fleet request carries (``Nats-Msg-Id``, the job id and the
model) that check was the largest single cost of receiving a message in a worker's profile, more than decoding
the JSON body. ``FleetNatsClient`` replaces only that function with one that returns the same dictionary (one
regular-expression search instead of a generator per name, and an all-ASCII block decoded once rather than each
name and value on its own). ``tests/test_nats_client.py`` holds it to the library's own parser on ordinary,
malformed, non-ASCII and generated header blocks, so a change in nats-py shows up there.

A subscription with a callback gets each message from nats-py through a queue and a task: a ``Msg`` built, put on
the queue, taken off by the task, and a coroutine of the callback started, for every message. A worker's pull
inbox receives every request it computes, so ``deliver_directly`` lets such a subscription have its messages
handed to a plain function as the read loop parses them (``fleet.brokers.nats_pull``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.subscription import Subscription

log = logging.getLogger(__name__)

_CRLF = b"\r\n"
_WHITESPACE = re.compile(r"\s")  # the characters str.isspace() accepts
_ASCII_WHITESPACE = " \t\n\r\x0b\x0c"  # the characters bytes.strip() strips


OnMessage = Callable[[str, str, bytes, "dict[str, str] | None"], None]
"""``(subject, reply, data, headers)`` of one message, called on the read loop as it is parsed."""


class FleetNatsClient(Client):
    """``nats.aio.client.Client`` with ``_parse_header_lines`` made cheap, and subscriptions whose messages can go
    straight to a function (``deliver_directly``); everything else is the library's."""

    def __init__(self) -> None:
        super().__init__()
        self._direct: dict[int, OnMessage] = {}

    def deliver_directly(self, sub: Subscription, on_message: OnMessage) -> None:
        """Hand ``sub``'s messages to ``on_message`` as the read loop parses them, instead of through the
        subscription's queue and task: no ``Msg`` object, no queue and no coroutine per message. ``on_message``
        must be quick: it runs inside the read loop (what it raises is logged and the message dropped). Only for a
        plain subscription (no JetStream context, no message limit); it lasts as long as the subscription, across
        reconnects (nats-py subscribes again under the same id)."""
        self._direct[sub._id] = on_message

    def _remove_sub(self, sid: int, max_msgs: int = 0) -> None:
        self._direct.pop(sid, None)
        super()._remove_sub(sid, max_msgs)

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes) -> None:
        on_message = self._direct.get(sid)
        if on_message is None:
            await super()._process_msg(sid, subject, reply, data, headers)
            return
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        try:
            on_message(subject.decode(), reply.decode(), data, await self._process_headers(headers))
        except Exception:  # never end the read loop over one message (nats-py would stop reading, connected)
            log.exception("a message on subscription %d could not be handled; dropped", sid)

    @staticmethod
    def _parse_header_lines(raw: bytes) -> dict[str, str]:
        if not raw.isascii():
            return _parse_lines(raw)
        # All ASCII (every Fleet header block): decoded once, then the same steps on text. The strip characters are
        # the ones bytes.strip() takes, which str.strip() would widen (it also strips \x1c-\x1f).
        out: dict[str, str] = {}
        for line in raw.decode("ascii").split("\r\n"):
            name, sep, value = line.partition(":")
            if not sep:
                continue
            key = name.strip(_ASCII_WHITESPACE)
            if (" " in key or not key.isprintable()) and _WHITESPACE.search(key):  # the search only when it may hit
                continue
            out[key] = value.strip(_ASCII_WHITESPACE)
        return out


def _parse_lines(raw: bytes) -> dict[str, str]:
    """The header block line by line, each name and value decoded on its own (a block with non-ASCII bytes)."""
    out: dict[str, str] = {}
    for line in raw.split(_CRLF):
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue  # a name that is not ASCII cannot be looked up: skipped, as the library does
        if _WHITESPACE.search(key):
            continue  # header names are tokens: the library drops names with whitespace inside
        out[key] = value.strip().decode("utf-8", "replace")
    return out
