"""One Redis pub/sub connection shared by every waiter of a store.

A gateway may hold thousands of waiters (WebSocket clients, long polls); each would cost a connection with a
pub/sub object of its own. ``PubSubMux`` keeps one connection, subscribes a channel while at least one waiter
watches it, and resolves the waiters' futures with the message data.

Waiters must never miss a completion, so the contract with the caller (``RedisStore.wait``) is:

* ``watch`` returns once the server confirmed the subscription, once the future is already resolved, or after
  ``timeout_s`` when neither happened. While the connection is down it waits for the reconnection, so an outage
  costs a waiter no failed reads. The caller then reads the record: a completion published before the subscription
  is visible in the record.
* A future resolves with the message data (``deliver`` does the same for a terminal record found another way, see
  ``fleet.store.recheck``), or with ``None`` meaning "re-check": the connection dropped or was (re-)established,
  so messages may have been lost; the caller watches again (which waits for the connection) and reads the record.

The connection is opened lazily by the first ``watch``. When it drops (or stops answering PING) the reader logs,
wakes every waiter with ``None``, reconnects with backoff, resubscribes every watched channel and wakes every
waiter with ``None`` once more: completions published while it was down are in the records that they then read.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable
from typing import Protocol

from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fleet.errors import StoreError
from fleet.tasks import cancel_and_wait

log = logging.getLogger(__name__)

SUBSCRIBE_CHUNK = 1000  # channels per SUBSCRIBE when resubscribing after a reconnect


class Connections(Protocol):
    """Where the mux gets its connection: a ``redis.asyncio.ConnectionPool``, or on a cluster
    ``fleet.store.cluster.NodeConnections`` (any node: a cluster forwards every PUBLISH to all of them)."""

    def make_connection(self) -> AbstractConnection: ...


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class PubSubMux:
    """Reference-counted channel subscriptions over one connection of ``pool``."""

    def __init__(
        self,
        pool: Connections,
        *,
        display_url: str,
        ping_interval_s: float = 5.0,
        max_backoff_s: float = 2.0,
        sharded: bool = False,
    ) -> None:
        self._pool = pool
        self._display_url = display_url
        self._ping_interval_s = ping_interval_s
        self._max_backoff_s = max_backoff_s
        # Sharded pub/sub (a cluster node's SSUBSCRIBE): the same bookkeeping, one channel per command (a sharded
        # subscription names channels of one slot only).
        self._sharded = sharded
        self._sub_cmd, self._unsub_cmd = ("SSUBSCRIBE", "SUNSUBSCRIBE") if sharded else ("SUBSCRIBE", "UNSUBSCRIBE")
        self._kinds = ("smessage", "ssubscribe") if sharded else ("message", "subscribe")
        self._conn: AbstractConnection | None = None
        self._waiters: dict[str, set[asyncio.Future[bytes | str | None]]] = {}
        self._subs: dict[str, asyncio.Future[None]] = {}  # subscribed on the current connection -> its ack
        self._acks: dict[str, deque[asyncio.Future[None]]] = {}  # acks owed by the server, FIFO per channel
        self._unsub_pending: set[str] = set()
        self._last: dict[str, bytes | str] = {}  # newest message of each channel subscribed without a break since
        self._lock = asyncio.Lock()  # orders SUBSCRIBE/UNSUBSCRIBE writes with the bookkeeping above
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._flush_task: asyncio.Task[None] | None = None
        self._closed = False
        self.connects = 0  # times the connection was (re-)established

    @property
    def watched_channels(self) -> int:
        return len(self._waiters)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    async def watch(self, channel: str, timeout_s: float) -> asyncio.Future[bytes | str | None]:
        """Register a waiter on ``channel``; return its future once the subscription is confirmed, the future is
        resolved or ``timeout_s`` passed. Always pair with ``release``."""
        if self._closed:
            raise self._closed_error()
        self._start()
        future: asyncio.Future[bytes | str | None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(channel, set()).add(future)
        try:
            async with asyncio.timeout(timeout_s):
                await self._until_connected(future)
                if not future.done() or future.result() is None:  # no record in hand: the read needs the ack
                    ack = await self._subscribe(channel)
                    await asyncio.shield(ack)
        except (TimeoutError, RedisError, OSError) as exc:
            # Degraded: the caller's read covers what happened so far, the re-check after reconnecting the rest.
            log.debug("subscription to %s not confirmed: %r", channel, exc)
        except BaseException:
            self.release(channel, future)
            raise
        if self._closed:  # closed while it waited: nothing will wake it any more
            self.release(channel, future)
            raise self._closed_error()
        if future.done() and future.result() is None:
            # Woken by the reconnection it was waiting for: the caller reads next anyway, so start afresh.
            self._waiters[channel].discard(future)
            future = asyncio.get_running_loop().create_future()
            self._waiters[channel].add(future)
        return future

    def _closed_error(self) -> StoreError:
        error = StoreError(f"the result store for {self._display_url} is closed")
        error.retriable = False  # waiting will not reopen it
        return error

    def deliver(self, channel: str, data: bytes | str) -> None:
        """Resolve the waiters of ``channel`` with ``data`` as if it had been published there."""
        for future in self._waiters.get(channel, ()):
            if not future.done():
                future.set_result(data)

    def last_message(self, channel: str) -> bytes | str | None:
        """The newest message received on ``channel`` while it has stayed subscribed since (None: none, or the
        subscription broke). A waiter that has seen it knows nothing newer was published before it watched
        again: what comes later wakes it, so it needs no read."""
        return self._last.get(channel)

    def watched(self) -> list[str]:
        """The channels with at least one waiter now."""
        return list(self._waiters)

    def release(self, channel: str, future: asyncio.Future[bytes | str | None]) -> None:
        """Drop one waiter; the last one out unsubscribes the channel (batched, in the background)."""
        waiters = self._waiters.get(channel)
        if waiters is None:
            return
        waiters.discard(future)
        if waiters:
            return
        del self._waiters[channel]
        self._unsub_pending.add(channel)
        if self._flush_task is None and not self._closed:
            self._flush_task = asyncio.create_task(self._flush_unsubscribes(), name="fleet-store-unsubscribe")

    async def close(self) -> None:
        """Stop the reader, close the connection and wake every waiter (their next ``watch`` raises)."""
        self._closed = True
        await cancel_and_wait([task for task in (self._task, self._flush_task) if task is not None])
        self._task = self._flush_task = None
        self._mark_disconnected()
        if self._conn is not None:
            await self._conn.disconnect()
            self._conn = None

    # -- subscriptions ----------------------------------------------------------------------------------------

    async def _until_connected(self, future: asyncio.Future[bytes | str | None]) -> None:
        """Wait until the connection is up or ``future`` is resolved (a terminal record found by a re-read)."""
        if self.connected or future.done():
            return
        connected: asyncio.Future[bytes | str | None] = asyncio.ensure_future(self._until_set())
        try:
            await asyncio.wait({connected, future}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            connected.cancel()

    async def _until_set(self) -> None:
        await self._connected.wait()

    def _start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="fleet-store-pubsub")

    async def _subscribe(self, channel: str) -> asyncio.Future[None]:
        async with self._lock:
            ack = self._subs.get(channel)
            if ack is None:
                ack = self._expect_acks([channel])[0]
                try:
                    await self._send(self._sub_cmd, channel)
                except BaseException:
                    self._forget_ack(channel, ack)
                    raise
            return ack

    def _expect_acks(self, channels: Iterable[str]) -> list[asyncio.Future[None]]:
        # Registered before the write: the reader may see the server's answer before the write call returns.
        loop = asyncio.get_running_loop()
        acks = []
        for channel in channels:
            ack: asyncio.Future[None] = loop.create_future()
            self._subs[channel] = ack
            self._acks.setdefault(channel, deque()).append(ack)
            acks.append(ack)
        return acks

    def _forget_ack(self, channel: str, ack: asyncio.Future[None]) -> None:
        if self._subs.get(channel) is ack:
            del self._subs[channel]
        acks = self._acks.get(channel)
        if acks and acks[-1] is ack:
            acks.pop()

    async def _flush_unsubscribes(self) -> None:
        try:
            async with self._lock:
                channels = [ch for ch in self._unsub_pending if ch not in self._waiters and ch in self._subs]
                self._unsub_pending.clear()
                for channel in channels:
                    del self._subs[channel]
                    self._last.pop(channel, None)
                if channels and self.connected:
                    await self._send_each(self._unsub_cmd, channels)
        except (RedisError, OSError) as exc:
            log.debug("unsubscribe failed (the reader reconnects): %r", exc)
        finally:
            self._flush_task = None
            if self._unsub_pending and not self._closed:
                self._flush_task = asyncio.create_task(self._flush_unsubscribes(), name="fleet-store-unsubscribe")

    async def _send(self, *args: str) -> None:
        if self._conn is None or not self.connected:
            raise RedisConnectionError(f"pub/sub connection to {self._display_url} is down")
        await self._conn.send_command(*args, check_health=False)

    async def _send_each(self, command: str, channels: list[str]) -> None:
        """``command`` for all ``channels`` in one write, or (sharded) one command per channel."""
        if not self._sharded:
            await self._send(command, *channels)
            return
        if self._conn is None or not self.connected:
            raise RedisConnectionError(f"pub/sub connection to {self._display_url} is down")
        await self._conn.send_packed_command(
            self._conn.pack_commands([(command, channel) for channel in channels]), check_health=False
        )

    # -- connection and reader --------------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff_s = 0.05
        while not self._closed:
            try:
                await self._connect()
                backoff_s = 0.05
                await self._read_loop()
            except (RedisError, OSError) as exc:
                if self.connected:
                    log.warning("pub/sub connection to %s lost (%s); reconnecting", self._display_url, exc)
                else:
                    log.debug("pub/sub connection to %s failed: %r", self._display_url, exc)
            except Exception:
                log.exception("pub/sub reader for %s failed; reconnecting", self._display_url)
            self._mark_disconnected()
            if self._conn is not None:
                await self._conn.disconnect(nowait=True)
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, self._max_backoff_s)

    async def _connect(self) -> None:
        if self._conn is None:
            self._conn = self._pool.make_connection()
        await self._conn.connect()
        async with self._lock:
            self._connected.set()
            channels = list(self._waiters)
            for start in range(0, len(channels), SUBSCRIBE_CHUNK):
                chunk = channels[start : start + SUBSCRIBE_CHUNK]
                self._expect_acks(chunk)
                await self._send_each(self._sub_cmd, chunk)
        self.connects += 1
        if self.connects > 1:
            log.info(
                "pub/sub connection to %s re-established; %d channels resubscribed", self._display_url, len(channels)
            )
        self._wake_all()

    async def _read_loop(self) -> None:
        conn = self._conn
        assert conn is not None
        awaiting_pong = False
        while True:
            response = await conn.read_response(
                timeout=self._ping_interval_s, disconnect_on_error=False, push_request=True
            )
            if response is not None:
                awaiting_pong = False
                self._dispatch(response)
                continue
            if awaiting_pong:
                raise RedisTimeoutError(f"no answer to PING within {2 * self._ping_interval_s:.0f}s")
            await conn.send_command("PING", check_health=False)
            awaiting_pong = True

    def _dispatch(self, response: object) -> None:
        if not isinstance(response, list) or len(response) < 3:
            return  # PONG outside subscribed mode
        kind, channel = _text(response[0]), _text(response[1])
        if kind == self._kinds[0]:
            if channel in self._subs:
                self._last[channel] = response[2]
            self.deliver(channel, response[2])
        elif kind == self._kinds[1]:
            acks = self._acks.get(channel)
            if acks:
                ack = acks.popleft()
                if not ack.done():
                    ack.set_result(None)
                if not acks:
                    del self._acks[channel]

    def _mark_disconnected(self) -> None:
        # Every waiter re-watches, which waits for the reconnection; the wake-up after it makes them read the record.
        self._connected.clear()
        self._subs.clear()
        self._last.clear()
        for acks in self._acks.values():
            for ack in acks:
                if not ack.done():
                    ack.set_result(None)
        self._acks.clear()
        self._wake_all()

    def _wake_all(self) -> None:
        for waiters in self._waiters.values():
            for future in waiters:
                if not future.done():
                    future.set_result(None)
