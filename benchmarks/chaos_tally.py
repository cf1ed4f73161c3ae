"""What ``benchmarks.chaos`` observes during a scenario and how it counts it.

* ``DoneWatcher``: every completion notice on ``fleet:done:*``, through one PSUBSCRIBE connection of its own that
  reconnects after a Redis restart.
* ``DeadLetters``: every distinct message on ``fleet.dlq.<model>``, read by a group of its own.
* ``read_computed``: the computations that ``benchmarks.chaos_model.CountingSleep`` logged; ``read_records``: the
  job records read back at the end.
* ``Tally.fill``: the row of the report (see the columns in ``benchmarks.chaos``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis import asyncio as aioredis
from redis.exceptions import RedisError

from benchmarks.chaos_model import MODEL, parse_computed_line
from fleet import constants as c
from fleet.brokers.base import Broker, Subscription

TERMINAL = frozenset({"succeeded", "failed", "cancelled", "expired"})
DLQ_GROUP = "chaos-dlq-count"
BAD_RE = re.compile(r"bad-\d{5}")  # the marker every garbage body carries (``benchmarks.chaos.plan``)


def say(key: str, message: str) -> None:
    print(f"[{key}] {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


# -- observers ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Notice:
    received: float
    terminal: tuple[str, float | None, str | None]  # state, finished_at, worker_id: one terminal write


def terminal_of(record: dict[str, Any]) -> tuple[str, float | None, str | None]:
    return str(record.get("state")), record.get("finished_at"), record.get("worker_id")


class DoneWatcher:
    """Counts completion notices on ``fleet:done:*`` per job, on a connection of its own that reconnects."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.notices: defaultdict[str, list[Notice]] = defaultdict(list)
        self.subscribed = asyncio.Event()
        self.reconnects = 0
        self._prefix = c.done_channel("")

    async def run(self) -> None:
        while True:
            client = aioredis.from_url(self.url, socket_connect_timeout=2)
            pubsub = client.pubsub()
            try:
                await pubsub.psubscribe(c.done_channel("*"))
                self.subscribed.set()
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None and message["type"] == "pmessage":
                        self._record(message["channel"], message["data"])
            except (RedisError, OSError):
                if self.subscribed.is_set():
                    self.reconnects += 1
                    self.subscribed.clear()
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                    await client.aclose()
            await asyncio.sleep(0.1)

    def _record(self, channel: bytes, data: bytes) -> None:
        job_id = channel.decode(errors="replace").removeprefix(self._prefix)
        try:
            record = json.loads(data)
        except ValueError:
            record = {"state": "unreadable"}
        self.notices[job_id].append(Notice(time.time(), terminal_of(record)))


class DeadLetters:
    """Reads ``fleet.dlq.<model>`` as a group of its own; keeps each distinct letter once (a redelivery is the same
    bytes; a second dead letter of one message has another ``failed_at``)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.letters: dict[str, str] = {}  # digest -> text
        self.by_marker: Counter[str] = Counter()  # garbage marker (bad-NNNNN) -> letters naming it
        self.by_job: Counter[str] = Counter()
        self._sub: Subscription | None = None

    async def run(self) -> None:
        try:
            await self._read()
        finally:  # cancelled at the end of the scenario: leave the group
            if self._sub is not None:
                with contextlib.suppress(Exception):
                    await self._sub.close()

    async def _read(self) -> None:
        failures = 0
        while True:
            try:
                if self._sub is None:
                    self._sub = await self.broker.subscribe(c.dlq_subject(MODEL), DLQ_GROUP)
                for delivery in await self._sub.fetch(256, 1.0):
                    self._record(delivery.data)
                    await delivery.ack()
                failures = 0
            except Exception as exc:  # the broker is down: retry, and subscribe again after repeated failures
                failures += 1
                if failures % 5 == 0 and self._sub is not None:
                    with contextlib.suppress(Exception):
                        await self._sub.close()
                    self._sub = None
                say("-", f"dead letters: {exc!r}; retrying")
                await asyncio.sleep(1)

    def _record(self, data: bytes) -> None:
        digest = hashlib.sha256(data).hexdigest()
        if digest in self.letters:
            return
        text = data.decode("utf-8", "replace")
        self.letters[digest] = text
        for marker in set(BAD_RE.findall(text)):
            self.by_marker[marker] += 1
        with contextlib.suppress(ValueError, AttributeError):
            job_id = json.loads(text).get("job_id")
            if isinstance(job_id, str):
                self.by_job[job_id] += 1


def read_computed(folder: Path) -> dict[str, list[float]]:
    """Start times of every computation of each job, from the handler's logs."""
    starts: defaultdict[str, list[float]] = defaultdict(list)
    for path in sorted(folder.glob("computed-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            parsed = parse_computed_line(line)
            if parsed is not None:
                starts[parsed[0]].append(parsed[1])
    return starts


async def read_records(client: aioredis.Redis, ids: list[str]) -> dict[str, dict[str, Any] | None]:
    out: dict[str, dict[str, Any] | None] = {}
    for i in range(0, len(ids), 1000):
        chunk = ids[i : i + 1000]
        for job_id, raw in zip(chunk, await client.mget([c.job_key(j) for j in chunk]), strict=True):
            try:
                out[job_id] = json.loads(raw) if raw else None
            except ValueError:
                out[job_id] = {"state": "unreadable"}
    return out


@dataclass(slots=True)
class Row:
    key: str
    title: str
    published: int = 0
    lost: int = 0
    second_terminals: int = 0
    computed_twice: int = 0
    after_stored: int = 0
    healthy_failed: int = 0
    no_notice: int = 0
    garbage: int = 0
    garbage_dead_lettered: int = 0
    dead_letters: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass(slots=True)
class Tally:
    """Everything observed in one scenario, turned into a row by ``fill``."""

    good: list[str]
    published: set[str]
    garbage_published: set[str]
    records: dict[str, dict[str, Any] | None]
    notices: dict[str, list[Notice]]
    computed: dict[str, list[float]]
    letters: DeadLetters

    def fill(self, row: Row) -> None:
        finals = {j: r for j, r in self.records.items() if r is not None and r.get("state") in TERMINAL}
        row.published = len(self.published)
        lost = Counter(str((self.records.get(j) or {}).get("state", "absent")) for j in self.published - set(finals))
        row.lost = sum(lost.values())
        failed = [finals[j] for j in self.published & set(finals) if finals[j].get("state") != "succeeded"]
        row.healthy_failed = len(failed)
        row.no_notice = sum(1 for j in self.published & set(finals) if not self.notices.get(j))
        row.second_terminals = sum(1 for j in set(self.notices) | set(finals) if self._terminals(j, finals) > 1)
        twice = [j for j, starts in self.computed.items() if len(starts) > 1]
        row.computed_twice = len(twice)
        row.after_stored = sum(1 for j in twice if self._recomputed_after_store(j, finals))
        row.garbage = len(self.garbage_published)
        row.garbage_dead_lettered = sum(1 for m in self.garbage_published if self.letters.by_marker[m])
        row.dead_letters = len(self.letters.letters)
        row.notes += self._notes(lost, failed)

    def _terminals(self, job_id: str, finals: dict[str, dict[str, Any]]) -> int:
        seen = {n.terminal for n in self.notices.get(job_id, [])}
        if job_id in finals:
            seen.add(terminal_of(finals[job_id]))
        return len(seen)

    def _recomputed_after_store(self, job_id: str, finals: dict[str, dict[str, Any]]) -> bool:
        notices = self.notices.get(job_id)
        stored_at = min(n.received for n in notices) if notices else (finals.get(job_id) or {}).get("finished_at")
        return stored_at is not None and any(start > stored_at for start in self.computed[job_id])

    def _notes(self, lost: Counter[str], failed: list[dict[str, Any]]) -> list[str]:
        notes = []
        if unpublished := len(self.good) - len(self.published):
            notes.append(f"{unpublished} good jobs never acknowledged by the broker (not counted)")
        if lost:
            notes.append("lost jobs by last state: " + ", ".join(f"{s} {n}" for s, n in lost.most_common()))
        if failed:
            kinds = Counter(f"{r.get('state')}/{(r.get('error') or {}).get('type')}" for r in failed)
            example = (failed[0].get("error") or {}).get("message")
            notes.append("healthy failed: " + ", ".join(f"{k} {n}" for k, n in kinds.most_common()))
            notes.append(f"  e.g. {example!r}")
        repeated = sum(1 for n in self.notices.values() if len(n) > len({x.terminal for x in n}))
        if repeated:
            notes.append(f"{repeated} jobs had the same terminal record announced more than once")
        letters_twice = sum(1 for m in self.garbage_published if self.letters.by_marker[m] > 1)
        if letters_twice:
            notes.append(f"{letters_twice} garbage messages were dead-lettered more than once")
        good_letters = sum(n for j, n in self.letters.by_job.items() if j in self.published)
        if good_letters:
            notes.append(f"{good_letters} dead letters of good jobs")
        return notes
