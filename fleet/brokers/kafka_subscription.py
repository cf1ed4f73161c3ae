"""A Kafka consumer-group member that behaves like a JetStream pull subscription.

Kafka has offsets, not per-message acks, so each assigned partition keeps a local ledger of what it handed out:

* **Commits.** The committed offset of a partition is the lowest offset not yet settled (acked or termed), or the
  next offset to fetch when everything is settled. A batch finished out of order never commits past unfinished
  work; settled messages above that point are delivered again only if the partition changes hands.
* **Redelivery.** ``nak`` and an expired ack wait put the message back on a local queue (the offset stays
  uncommitted) and the same consumer hands it out again, with ``delivery_count`` one higher, before new records.
* **Delivery counts** live in the metadata of each commit (see ``kafka_names``). Before ``fetch`` hands a batch
  out it commits the counts of its messages (together with the acks so far) and waits for that commit at most
  ``count_commit_wait_s``. The guarantee: a message of a batch whose count commit succeeded reaches its next owner
  (after a crash, a lost session or a hand-over) with a ``delivery_count`` higher than any it was handed out with,
  so a message that keeps killing its worker reaches ``max_deliveries``. A batch whose count commit failed (the
  group was rebalancing) or did not answer within the wait (a coordinator stall) is handed out anyway, with a
  warning: its counts reach Kafka with the next commit that succeeds (the late one, the next fetch's or the next
  ack's), and a crash before then makes its next owner start from the counts committed before it. While a
  count commit is stuck past the wait, later batches go out without waiting (one pause per stall, not per batch).
* **De-duplication.** Records keyed by the same job id land on the same partition; a record whose key was seen on
  that partition within ``dedup_window_s`` (by record timestamp) is settled without being handed out.
* **Rebalances** (aiokafka's eager protocol revokes every partition): on revocation the consumer stops handing
  out messages of the partition and commits what is settled. A partition assigned back unchanged keeps its ledger;
  one that moved is dropped, and its unsettled deliveries become stale (settling them is a no-op) because the new
  owner redelivers them. The store's terminal compare-and-set keeps such a job to one terminal result.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, ConsumerStoppedError, IllegalStateError, KafkaError
from aiokafka.structs import OffsetAndMetadata

from fleet.brokers.base import Delivery
from fleet.brokers.kafka_names import (
    PriorDeliveries,
    decode_deliveries,
    encode_deliveries,
    runs_of,
    start_client,
    stop_client,
)
from fleet.brokers.recent import RecentKeys
from fleet.constants import HEADER_MSG_ID
from fleet.errors import BrokerError
from fleet.tasks import cancel_and_wait, wait_event

log = logging.getLogger(__name__)

COMMIT_DELAY_S = 0.2
COUNT_COMMIT_WAIT_S = 1.0
MIN_POLL_S = 0.01
MAX_SEEN_IDS = 100_000  # message ids remembered per partition for de-duplication
ReadCommitted = Callable[[set[TopicPartition]], Any]  # async (tps) -> {tp: OffsetAndMetadata}


@dataclass(eq=False, slots=True)
class _Entry:
    """One record handed out (or about to be) from a partition, until the commit point passes it."""

    ledger: _Ledger
    offset: int
    key: str | None
    value: bytes
    headers: Sequence[tuple[str, bytes]]  # as the record carries them; each delivery decodes its own copy
    deliveries: int
    settled: bool = False
    in_flight: bool = False
    deadline: float = 0.0  # monotonic; when an in-flight delivery's ack wait runs out
    ready_at: float | None = None  # monotonic; when a queued redelivery may go out


@dataclass(eq=False)
class _Ledger:
    """Per-partition state: entries from the commit point up, the next offset to admit, the last commit."""

    tp: TopicPartition
    prior: PriorDeliveries | None
    last_commit: tuple[int, str] | None
    seen_ids: RecentKeys  # msg id -> record timestamp (ms), for de-duplication
    entries: OrderedDict[int, _Entry] = field(default_factory=OrderedDict)
    next_offset: int | None = None
    active: bool = True  # False once the partition moved to another consumer
    suspended: bool = False  # between revocation and re-assignment

    def commit_point(self) -> int | None:
        while self.entries:
            offset, entry = next(iter(self.entries.items()))
            if not entry.settled:
                return offset
            self.entries.popitem(last=False)
        return self.next_offset

    def metadata(self) -> str:
        runs: list[tuple[int, int]] = []  # runs_of() of the entries, built in one pass (this runs on every commit)
        last = -1
        for entry in self.entries.values():
            if entry.deliveries != last:
                last = entry.deliveries
                runs.append((entry.offset, last))
        until = self.next_offset or 0
        if self.prior is not None and self.prior.until > until:
            runs = runs_of(runs + self.prior.runs_from(until))
            until = self.prior.until
        return encode_deliveries(until, runs)

    def is_duplicate(self, key: str | None, timestamp_ms: int) -> bool:
        """Whether a record with this key was admitted within the de-duplication window; remembers it if not."""
        if key is None:
            return False
        if self.seen_ids.seen(key, timestamp_ms):
            return True
        self.seen_ids.add(key, timestamp_ms)
        return False


class KafkaDelivery:
    """A message handed out by ``KafkaSubscription.fetch``; implements ``fleet.brokers.base.Delivery``."""

    __slots__ = ("_attempt", "_entry", "_headers", "_sub", "data", "delivery_count", "msg_id", "subject")

    def __init__(self, sub: KafkaSubscription, entry: _Entry) -> None:
        self._sub, self._entry, self._attempt = sub, entry, entry.deliveries
        self.subject = sub.topic
        self.data = entry.value
        self._headers: dict[str, str] | None = None
        self.msg_id = entry.key
        self.delivery_count = entry.deliveries

    @property
    def headers(self) -> dict[str, str]:
        """The record's headers, decoded on first use (a worker in pull mode never reads them)."""
        if self._headers is None:
            self._headers = _decode_headers(self._entry.headers)
        return self._headers

    @headers.setter
    def headers(self, value: dict[str, str]) -> None:
        self._headers = value

    @property
    def offset(self) -> int:
        return self._entry.offset

    @property
    def partition(self) -> int:
        return self._entry.ledger.tp.partition

    async def ack(self) -> None:
        self._sub.settle(self._entry)

    async def term(self) -> None:
        self._sub.settle(self._entry)

    async def nak(self, delay_s: float = 0.0) -> None:
        self._sub.requeue(self._entry, self._attempt, delay_s)

    async def in_progress(self) -> None:
        self._sub.touch(self._entry, self._attempt)


def _decode_headers(headers: Sequence[tuple[str, bytes]]) -> dict[str, str]:
    return {k: v.decode(errors="replace") for k, v in headers}


class _Listener(ConsumerRebalanceListener):
    def __init__(self, sub: KafkaSubscription) -> None:
        self._sub = sub

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._sub.on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._sub.on_assigned(assigned)


class KafkaSubscription:
    """One member of a consumer group on one topic. Build with ``KafkaBroker.subscribe``."""

    partitioned = True  # what this member fetched is its partitions' alone

    def __init__(
        self,
        topic: str,
        group: str,
        *,
        consumer_options: dict[str, Any],
        read_committed: ReadCommitted,
        ack_wait_s: float,
        dedup_window_s: float,
        commit_timeout_s: float,
        on_close: Callable[[KafkaSubscription], None],
        count_commit_wait_s: float = COUNT_COMMIT_WAIT_S,
    ) -> None:
        self.topic, self.group = topic, group
        self._commit_timeout_s = commit_timeout_s
        self._count_commit_wait_s = min(count_commit_wait_s, commit_timeout_s)
        self._count_commits: set[asyncio.Task[None]] = set()
        self._stuck_commit: asyncio.Task[None] | None = None  # a count commit still running past its wait
        self._counts_committed_at = -math.inf  # monotonic time the last count commit was sent
        self._ack_wait_s = ack_wait_s
        self._dedup_window_ms = int(dedup_window_s * 1000)
        self._read_committed = read_committed
        self._on_close = on_close
        self._consumer = AIOKafkaConsumer(group_id=group, enable_auto_commit=False, **consumer_options)
        self._ledgers: dict[TopicPartition, _Ledger] = {}
        self._suspended: dict[TopicPartition, _Ledger] = {}
        self._in_flight: set[_Entry] = set()
        # No in-flight deadline is earlier than this (a lower bound, exact after each scan): fetch looks for expired
        # ack waits only once it has passed, instead of scanning every delivery in flight on every call.
        self._expiry_check_at = math.inf
        self._queue: list[tuple[float, int, _Entry]] = []  # (ready_at, offset, entry) heap of redeliveries
        self._assigned_once = asyncio.Event()
        self._dirty = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self._fetch_lock = asyncio.Lock()
        self._closed = False
        self._started = False

    async def start(self, join_timeout_s: float) -> None:
        self._consumer.subscribe([self.topic], listener=_Listener(self))
        await start_client(self._consumer.start, self._consumer.stop)  # stopped again on any error or cancellation
        self._started = True
        self._flusher = asyncio.create_task(self._flush_loop(), name=f"kafka-commit-{self.topic}")
        if not await wait_event(self._assigned_once, join_timeout_s):
            log.warning("group %r on %r: no partition assignment within %.0fs", self.group, self.topic, join_timeout_s)

    # -- fetch ------------------------------------------------------------------------------------------------

    async def fetch(self, max_messages: int, timeout_s: float) -> list[Delivery]:
        """Up to ``max_messages`` messages: queued redeliveries first, then new records; ``[]`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        async with self._fetch_lock:
            while not self._closed:
                now = time.monotonic()
                self._expire(now)
                out = self._take_ready(max_messages, now)
                if len(out) < max_messages:
                    out += await self._poll(max_messages - len(out), self._wait_s(bool(out), now, deadline))
                if out:
                    await self._commit_counts()  # before anyone works on these: see "Delivery counts" above
                    return out
                if time.monotonic() >= deadline:
                    return []
        return []

    async def _commit_counts(self) -> None:
        stuck = self._stuck_commit
        if stuck is not None and not stuck.done():
            self._dirty.set()  # the ack committer takes these counts along once the stuck commit is over
            return
        self._counts_committed_at = time.monotonic()
        commit = asyncio.create_task(self._commit_logged(), name=f"kafka-count-commit-{self.topic}")
        self._count_commits.add(commit)
        commit.add_done_callback(self._count_commits.discard)
        done, _ = await asyncio.wait({commit}, timeout=self._count_commit_wait_s)  # a cancelled fetch leaves it running
        if not done:
            self._stuck_commit = commit
            log.warning(
                "group %r on %r: delivery counts not committed within %.1fs; handing the batch out anyway "
                "(a crash before the commit lands restarts its counts)",
                self.group,
                self.topic,
                self._count_commit_wait_s,
            )

    async def _commit_logged(self) -> None:
        try:
            await self.commit()
        except Exception:
            log.exception("group %r: commit of delivery counts failed", self.group)

    async def _poll(self, max_records: int, wait_s: float) -> list[Delivery]:
        try:
            batches = await self._consumer.getmany(timeout_ms=int(wait_s * 1000), max_records=max_records)
        except ConsumerStoppedError:
            return []
        except KafkaError as exc:
            raise BrokerError(f"Kafka fetch from {self.topic!r} for group {self.group!r} failed: {exc}") from exc
        out: list[Delivery] = []
        now = time.monotonic()
        for tp, records in batches.items():
            ledger = self._ledgers.get(tp)
            if ledger is None or ledger.suspended:
                continue  # revoked meanwhile: the next owner fetches these
            for record in records:
                delivery = self._admit(ledger, record, now)
                if delivery is not None:
                    out.append(delivery)
        return out

    def _admit(self, ledger: _Ledger, record: ConsumerRecord[bytes, bytes], now: float) -> KafkaDelivery | None:
        offset = record.offset
        if ledger.next_offset is not None and offset < ledger.next_offset:
            return None  # already in the ledger (re-fetched after a rebalance)
        ledger.next_offset = offset + 1
        # The key is the job id; a producer that only set the NATS-style header is understood too.
        if record.key is not None:
            key: str | None = record.key.decode(errors="replace")
        else:
            key = _decode_headers(record.headers).get(HEADER_MSG_ID)
        prior = ledger.prior.count(offset) if ledger.prior else 0
        entry = _Entry(ledger, offset, key, record.value or b"", record.headers, prior)
        ledger.entries[offset] = entry
        if ledger.is_duplicate(key, record.timestamp):
            log.debug("dropping duplicate %r at %s offset %d", key, ledger.tp, offset)
            entry.settled = True
            self._dirty.set()
            return None
        return self._hand_out(entry, now)

    def _hand_out(self, entry: _Entry, now: float) -> KafkaDelivery:
        entry.deliveries += 1
        entry.in_flight, entry.ready_at = True, None
        entry.deadline = now + self._ack_wait_s
        self._in_flight.add(entry)
        if entry.deadline < self._expiry_check_at:
            self._expiry_check_at = entry.deadline
        return KafkaDelivery(self, entry)

    def _expire(self, now: float) -> None:
        if now < self._expiry_check_at:
            return
        self._expiry_check_at = min((e.deadline for e in self._in_flight if e.deadline > now), default=math.inf)
        expired = [e for e in self._in_flight if e.deadline <= now]
        for entry in expired:
            log.debug("ack wait ran out for %s offset %d: redelivering", entry.ledger.tp, entry.offset)
            self._enqueue(entry, now)

    def _take_ready(self, max_messages: int, now: float) -> list[Delivery]:
        out: list[Delivery] = []
        held: list[tuple[float, int, _Entry]] = []
        while self._queue and len(out) < max_messages and self._queue[0][0] <= now:
            item = heapq.heappop(self._queue)
            entry = item[2]
            if entry.settled or not entry.ledger.active or entry.ready_at != item[0]:
                continue  # stale queue item
            if entry.ledger.suspended:
                held.append(item)
                continue
            out.append(self._hand_out(entry, now))
        for item in held:
            heapq.heappush(self._queue, item)
        return out

    def _wait_s(self, have_some: bool, now: float, deadline: float) -> float:
        if have_some:
            return 0.0
        # At least MIN_POLL_S, so that queued work held back by a rebalance cannot make this loop spin.
        return max(0.0, min(deadline - now, max(self._next_wake(deadline) - now, MIN_POLL_S)))

    def _next_wake(self, deadline: float) -> float:
        wake = deadline
        if self._queue:
            wake = min(wake, self._queue[0][0])
        if self._in_flight:
            wake = min(wake, self._expiry_check_at)
        return wake

    def _enqueue(self, entry: _Entry, ready_at: float) -> None:
        self._in_flight.discard(entry)
        entry.in_flight, entry.ready_at = False, ready_at
        heapq.heappush(self._queue, (ready_at, entry.offset, entry))

    # -- settling (called by KafkaDelivery) -------------------------------------------------------------------

    def settle(self, entry: _Entry) -> None:
        if entry.settled or not entry.ledger.active:
            return
        entry.settled, entry.in_flight, entry.ready_at = True, False, None
        self._in_flight.discard(entry)
        self._dirty.set()

    def requeue(self, entry: _Entry, attempt: int, delay_s: float) -> None:
        if self._current(entry, attempt):
            self._enqueue(entry, time.monotonic() + max(0.0, delay_s))

    def touch(self, entry: _Entry, attempt: int) -> None:
        if self._current(entry, attempt):
            entry.deadline = time.monotonic() + self._ack_wait_s

    @staticmethod
    def _current(entry: _Entry, attempt: int) -> bool:
        return entry.in_flight and not entry.settled and entry.ledger.active and entry.deliveries == attempt

    # -- commits ----------------------------------------------------------------------------------------------

    async def commit(self, tps: set[TopicPartition] | None = None) -> None:
        """Commit each partition's commit point and delivery record (only what changed; failures are logged)."""
        offsets: dict[TopicPartition, OffsetAndMetadata] = {}
        for tp, ledger, point in self._commit_points():
            if tps is not None and tp not in tps:
                continue
            wanted = (point, ledger.metadata())
            if wanted != ledger.last_commit:
                offsets[tp] = OffsetAndMetadata(*wanted)
        if offsets:
            await self._send_commit(offsets)

    async def _send_commit(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        try:
            # aiokafka waits for a group coordinator without end; a fetch must not hang on a broker outage.
            async with asyncio.timeout(self._commit_timeout_s):  # like wait_for, without a task per commit
                await self._consumer.commit(offsets)
        except TimeoutError:
            log.warning("group %r: offset commit timed out after %.1fs", self.group, self._commit_timeout_s)
            return
        except (CommitFailedError, IllegalStateError) as exc:
            log.info("group %r: commit skipped while the group rebalances: %s", self.group, exc)
            return
        except KafkaError as exc:
            log.warning("group %r: offset commit failed (retried on the next one): %s", self.group, exc)
            return
        for tp, committed in offsets.items():
            ledger = self._ledgers.get(tp) or self._suspended.get(tp)
            if ledger is not None:
                ledger.last_commit = (committed.offset, committed.metadata)

    async def _flush_loop(self) -> None:
        # Acks are committed in the background, at most every COMMIT_DELAY_S: a busy consumer's next fetch
        # commits them anyway (one commit per batch), an idle one gets them committed shortly after. While fetches
        # commit, this one stays out of their way (commits of a consumer are serialised).
        while True:
            await self._dirty.wait()
            await asyncio.sleep(COMMIT_DELAY_S)
            if time.monotonic() - self._counts_committed_at < COMMIT_DELAY_S:
                continue  # a fetch committed the acks so far with its counts, and the next fetch takes the rest
            self._dirty.clear()
            try:
                await self.commit()
            except Exception:
                log.exception("group %r: background commit failed", self.group)

    async def flush(self) -> None:
        """Commit everything settled so far."""
        if not self._closed and self._started:
            await self.commit()

    def settled_offsets(self) -> dict[TopicPartition, int]:
        """Per assigned partition, the offset a commit would store now: what ``commit`` would send, without the
        round trip (``lag`` adds local acks this way instead of committing on every poll)."""
        if self._closed or not self._started:
            return {}
        return {tp: point for tp, _, point in self._commit_points()}

    def _commit_points(self) -> Iterator[tuple[TopicPartition, _Ledger, int]]:
        """Each assigned partition with something to commit, and its commit point."""
        assigned = self._consumer.assignment()
        for tp, ledger in self._ledgers.items():  # suspended (revoked) ledgers are not assigned
            point = ledger.commit_point() if tp in assigned else None
            if point is not None:
                yield tp, ledger, point

    # -- rebalances -------------------------------------------------------------------------------------------

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.commit(revoked)
        for tp in revoked:
            ledger = self._ledgers.pop(tp, None)
            if ledger is not None:
                ledger.suspended = True
                self._suspended[tp] = ledger

    async def on_assigned(self, assigned: set[TopicPartition]) -> None:
        committed = await self._committed(assigned)
        for tp in assigned:
            self._ledgers[tp] = self._resume(tp, committed.get(tp))
        for ledger in self._suspended.values():
            self._drop(ledger)
        self._suspended.clear()
        self._assigned_once.set()
        log.info(
            "group %r on %r: assigned partitions %s", self.group, self.topic, sorted(p.partition for p in assigned)
        )

    async def _committed(self, tps: set[TopicPartition]) -> dict[TopicPartition, OffsetAndMetadata]:
        if not tps:
            return {}
        try:
            return dict(await self._read_committed(tps))
        except Exception as exc:  # delivery counts restart at 1; offsets still come from the group
            log.warning("group %r: reading committed offsets failed: %s", self.group, exc)
            return {}

    def _resume(self, tp: TopicPartition, committed: OffsetAndMetadata | None) -> _Ledger:
        found = (committed.offset, committed.metadata) if committed and committed.offset >= 0 else None
        old = self._suspended.pop(tp, None)
        if old is not None and old.last_commit == found:
            old.suspended = False  # nobody else owned it meanwhile: keep the ledger and its in-flight deliveries
            if old.next_offset is not None:
                self._consumer.seek(tp, old.next_offset)
            return old
        if old is not None:
            self._drop(old)
        seen = RecentKeys(self._dedup_window_ms, MAX_SEEN_IDS)
        return _Ledger(tp, decode_deliveries(found[1]) if found else None, found, seen)

    def _drop(self, ledger: _Ledger) -> None:
        ledger.active = False
        for entry in ledger.entries.values():
            self._in_flight.discard(entry)
        ledger.entries.clear()

    # -- lifecycle --------------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Commit what is settled and leave the group; unsettled messages go to the partitions' next owners."""
        if self._closed:
            return
        self._closed = True
        self._on_close(self)
        if self._flusher is not None:
            await cancel_and_wait([self._flusher])
        try:
            running = set(self._count_commits)
            for commit in running:  # the last commit below covers what they were sending
                commit.cancel()
            if running:
                await asyncio.wait(running)
            if self._started:
                await self.commit()
        finally:
            await stop_client(self._consumer.stop)
            for ledger in [*self._ledgers.values(), *self._suspended.values()]:
                self._drop(ledger)

    @property
    def closed(self) -> bool:
        return self._closed

    def __del__(self, _warnings: Any = warnings) -> None:
        if not getattr(self, "_closed", True):
            _warnings.warn(
                f"unclosed KafkaSubscription on {self.topic!r} (group {self.group!r}): call close()",
                ResourceWarning,
                source=self,
                stacklevel=1,
            )
