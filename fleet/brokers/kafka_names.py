"""Helpers of the Kafka broker: URLs, subject-to-topic names, delivery-count records, starting and stopping clients.

Topic names: Kafka allows ``[a-zA-Z0-9._-]`` (at most 249 characters), and Fleet's subjects use only those
characters (model names match ``[a-z0-9][a-z0-9_-]*``), so a subject is used verbatim as its topic name:
``fleet.req.echo`` is the topic ``fleet.req.echo``. A subject with other characters is a ``ConfigError``.

Delivery counts: Kafka keeps none, so the consumer stores them in the metadata string of its offset commits
(``fleet1|<until>|<start>:<count>,...``): every offset from the committed one up to ``until`` was handed out, the
runs say how many times. A consumer that takes a partition over (after a rebalance or a crash) reads the record
and continues the counts, so a message redelivered to another process arrives with ``delivery_count >= 2``.

Clients: aiokafka cannot take a cancellation half-way through ``start()`` (``AIOKafkaClient.bootstrap`` leaves its
bootstrap connection open) and a client dropped without ``stop()`` warns at garbage collection. Every producer,
consumer and admin client Fleet creates is started with ``start_client`` and stopped with ``stop_client``, so that
an error, a timeout or a cancellation (a lag read cancelled by a shutting-down app) never leaves one behind.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from fleet.brokers.subjects import check_subject
from fleet.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_PORT = 9092
TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
DELIVERIES_VERSION = "fleet1"
MAX_DELIVERY_RUNS = 100  # keeps the commit metadata well under the broker's offset.metadata.max.bytes (4096)


def bootstrap_servers(url: str) -> list[str]:
    """``kafka://h1:9092,h2:9092`` -> ``["h1:9092", "h2:9092"]`` (the port defaults to 9092)."""
    parts = urlsplit(url)
    if parts.scheme != "kafka":
        raise ConfigError(f"Kafka URL {url!r} must start with kafka://")
    hosts = [h.strip() for h in parts.netloc.rsplit("@", 1)[-1].split(",") if h.strip()]
    if not hosts:
        raise ConfigError(f"Kafka URL {url!r} names no broker; expected kafka://host:port[,host:port...]")
    return [h if _has_port(h) else f"{h}:{DEFAULT_PORT}" for h in hosts]


def _has_port(host: str) -> bool:
    if host.startswith("["):  # IPv6 literal: [::1] or [::1]:9092
        return "]:" in host
    return ":" in host


def topic_for(subject: str) -> str:
    """The Kafka topic that carries ``subject``: the subject itself, checked against Kafka's naming rules."""
    check_subject(subject)
    if not TOPIC_RE.match(subject):
        raise ConfigError(
            f"subject {subject!r} cannot be a Kafka topic name: use at most 249 of the characters [a-zA-Z0-9._-]"
        )
    return subject


@dataclass(frozen=True, slots=True)
class PriorDeliveries:
    """Delivery counts read from a partition's committed metadata: runs of (first offset, count) up to ``until``."""

    until: int
    starts: tuple[int, ...]
    counts: tuple[int, ...]

    def count(self, offset: int) -> int:
        """How many times ``offset`` was handed out before (0 when never, as far as the record says)."""
        if offset >= self.until or not self.starts or offset < self.starts[0]:
            return 0
        return self.counts[bisect.bisect_right(self.starts, offset) - 1]

    def runs_from(self, offset: int) -> list[tuple[int, int]]:
        """The runs that cover ``offset`` and above, the first clipped to start at ``offset``."""
        if offset >= self.until or not self.starts:
            return []
        i = max(bisect.bisect_right(self.starts, offset) - 1, 0)
        runs = list(zip(self.starts[i:], self.counts[i:], strict=True))
        if runs and runs[0][0] < offset:
            runs[0] = (offset, runs[0][1])
        return runs


def runs_of(pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Run-length encode ascending (offset, count) pairs into (first offset, count) runs."""
    runs: list[tuple[int, int]] = []
    for offset, count in pairs:
        if not runs or runs[-1][1] != count:
            runs.append((offset, count))
    return runs


def _shrink(runs: list[tuple[int, int]], max_runs: int) -> list[tuple[int, int]]:
    # Merging two neighbouring runs keeps the larger count: a count may be overstated, never understated.
    while len(runs) > max_runs:
        merged = [(runs[i][0], max(runs[i][1], runs[i + 1][1])) for i in range(0, len(runs) - 1, 2)]
        if len(runs) % 2:
            merged.append(runs[-1])
        runs = runs_of(merged)
    return runs


def encode_deliveries(until: int, runs: list[tuple[int, int]], max_runs: int = MAX_DELIVERY_RUNS) -> str:
    body = ",".join(f"{start}:{count}" for start, count in _shrink(runs, max_runs))
    return f"{DELIVERIES_VERSION}|{until}|{body}"


def decode_deliveries(metadata: str | None) -> PriorDeliveries | None:
    """Parse commit metadata written by ``encode_deliveries``; anything else (another client's) gives None."""
    if not metadata or not metadata.startswith(DELIVERIES_VERSION + "|"):
        return None
    try:
        _, until, body = metadata.split("|", 2)
        runs = [tuple(int(x) for x in item.split(":", 1)) for item in body.split(",") if item]
        return PriorDeliveries(int(until), tuple(r[0] for r in runs), tuple(r[1] for r in runs))
    except ValueError:
        return None


# -- starting and stopping aiokafka clients ----------------------------------------------------------------------

Step = Callable[[], Awaitable[None]]
_STOPPING: set[asyncio.Future[None]] = set()  # clean-ups that may outlive their caller; held so they finish


async def start_client(start: Step, stop: Step, *, timeout_s: float | None = None) -> None:
    """Run ``start`` (an aiokafka client's ``start``); on any exit but success, ``stop`` the client and re-raise.

    ``start`` runs in a task of its own that the caller's cancellation does not reach, and ``stop`` runs only once
    it ended (stopping a client whose start is still running leaves behind what the start creates afterwards):

    * the start fails: the client is stopped, then the start's error is raised;
    * the caller is cancelled: it waits for the start to end and for ``stop``, then re-raises ``CancelledError``;
    * ``timeout_s`` passes first: ``TimeoutError`` at once, the clean-up goes on in the background
      (``await stopping_clients()`` waits for it).
    """
    starting = asyncio.ensure_future(start())
    try:
        done, _ = await asyncio.wait({starting}, timeout=timeout_s)
    except BaseException:
        await asyncio.shield(_keep(_stop_after(starting, stop)))
        raise
    if not done:
        _keep(_stop_after(starting, stop))
        raise TimeoutError(f"no answer within {timeout_s}s")
    if starting.cancelled() or starting.exception() is not None:
        await asyncio.shield(_keep(_stop_after(starting, stop)))
    starting.result()  # the start's own error, if any


async def stop_client(stop: Step) -> None:
    """Run ``stop`` to the end even if the caller is cancelled meanwhile; a failure is logged (the client is gone),
    and a ``CancelledError`` that aiokafka raises from its own tasks (a stop while the broker is down) is not
    passed on to the caller, which was not cancelled."""
    await asyncio.shield(_keep(_stop_quietly(stop)))


async def stopping_clients() -> None:
    """Wait for the clean-ups that ``start_client`` and ``stop_client`` left running in this event loop."""
    loop = asyncio.get_running_loop()
    pending = [task for task in _STOPPING if task.get_loop() is loop]
    if pending:
        await asyncio.wait(pending)


def _keep(step: Awaitable[None]) -> asyncio.Future[None]:
    task = asyncio.ensure_future(step)
    _STOPPING.add(task)
    task.add_done_callback(_STOPPING.discard)
    return task


async def _stop_after(starting: asyncio.Future[None], stop: Step) -> None:
    await asyncio.wait({starting})
    if not starting.cancelled():
        starting.exception()  # retrieved here: the caller raises it, or nobody waits for it any more
    await _stop_quietly(stop)


async def _stop_quietly(stop: Step) -> None:
    try:
        await stop()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # this clean-up itself was cancelled (the loop is closing): let it end
        # aiokafka's ``stop`` re-raises the cancellation of its own background tasks when the broker is away
        # (the coordinator's, the fetcher's): the client is stopped all the same, and that is no error of ours.
        log.debug("a Kafka client's stop ended with the cancellation of its own tasks")
    except Exception as exc:
        log.warning("stopping a Kafka client failed: %r", exc)
