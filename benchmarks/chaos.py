"""Long fault runs: how many jobs are lost, settled twice, computed twice or failed when parts of Fleet are killed.

    python -m benchmarks.chaos [--quick] [--scenarios a,b,c,d,e,f] [--jobs 10000] [--rate 250] ...

Every scenario runs on its own fresh redis-server (AOF on, ``appendfsync always``) and nats-server (JetStream, its
store in a directory kept across restarts), or on one single-node Kafka shared by the Kafka scenarios, all on
127.0.0.1 ports chosen here. ``--workers`` ``fleet worker`` processes serve ``benchmarks.chaos_model:CountingSleep``
(``sleep`` with a fixed 2 ms per item, batches of up to 8, that logs every job it computes). Then:

a. NATS + Redis: every ``--kill-every-s`` the longest-running *ready* worker is SIGKILLed and a new one is started.
   A worker that is still starting is not killed, nor the last ready one unless ``--kill-last``: on a loaded
   machine start-up takes far longer than the period (60-100 s on a busy 2-core machine), and killing every
   worker would measure the start-up time, with jobs counted lost only because the deadline came first.
b. the same on Kafka + Redis.
c. nats-server SIGKILLed once ``--fault-at`` of the jobs are published, restarted ``--down-s`` later.
d. redis-server SIGKILLed the same way and restarted from its AOF.
e. dispatch routing: workers read their inboxes, two ``fleet dispatcher`` processes fill them; one dispatcher is
   SIGKILLed mid-run and a new one started ``--down-s`` later.
f. ``--garbage`` raw bodies on the request subject among the good ones: JSON nested ``--depth`` levels deep,
   invalid UTF-8, JSON that is not an object, integers of 5,000 digits, ``1e999``, a lone surrogate in the job id.
   Each must end on ``fleet.dlq.<model>``; every good job must still succeed.

A fleet process that exits by itself is restarted at once (a supervisor would); such exits are listed in the notes.

Jobs are published straight to the model's subject from this process with Fleet's broker client, the way
``fleet publish`` and the SDK do: the job id is the message id, the worker creates the record. That exercises the
whole worker path, record creation included, and makes "published" exact: a job counts once the broker
acknowledged it. A publish that fails during an outage is retried with the same message id (JetStream drops the
repeat; on Kafka a repeat is a second message of the same job, which the worker must settle without recomputing),
as a producer would. A gateway was not put in front: it writes the record before publishing, so during a Redis
outage it refuses submissions and fewer jobs would be in flight when the fault hits.

Columns of the table (rows: scenarios):

* published: good jobs the broker acknowledged; lost: of those, jobs without a terminal record at the end. A
  scenario ends when every published job is terminal (in f: and every garbage message dead-lettered), or at its
  deadline, ``--grace-s`` after the last publish; then the fleet is stopped and every record read back.
* 2nd terminal: jobs for which more than one distinct terminal record (state, ``finished_at``, worker) was seen,
  in the completion notices counted on ``fleet:done:*`` (one PSUBSCRIBE connection of its own, reconnected after a
  Redis restart) together with the record read at the end. A notice repeated with the same record is not one.
* computed 2x: jobs the model computed to the end more than once (from the handler's logs). A worker SIGKILLed
  between computing and storing causes that legitimately; "after stored" counts those computed again although the
  computation began after the first result was stored (after its completion notice was received, or after the
  record's ``finished_at`` where no notice was seen).
* healthy failed: published good jobs that ended ``failed``, ``expired`` or ``cancelled``.
* no notice: terminal good jobs whose completion was never announced on ``fleet:done:<id>`` (a notice published
  while the watcher reconnected would also be missed; the notes give its reconnects).
* garbage DLQ: (f) garbage messages found on the dead-letter subject / garbage messages published; dead letters:
  every message on it. time: seconds from the first publish to the end.

Progress goes to stderr; logs of every process and server to ``benchmarks/results/chaos/<scenario>/``, the rows to
``benchmarks/results/chaos.json``. This is a measurement, not a test: the exit code is 0 whatever the numbers, and
1 only when the harness itself failed (a server that would not start, a fleet that never became ready).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from redis import asyncio as aioredis
from redis.exceptions import RedisError
from rich.console import Console
from rich.table import Table

from benchmarks.chaos_model import COMPUTED_DIR_ENV, MODEL, CountingSleep
from benchmarks.chaos_tally import TERMINAL, DeadLetters, DoneWatcher, Row, Tally, read_computed, read_records, say
from benchmarks.common import RESULTS_DIR, record, stop_processes, write_result
from fleet import constants as c
from fleet.brokers import make_broker
from fleet.brokers.base import Broker
from fleet.brokers.events import validated
from fleet.schemas.wire import DispatcherBeat, Heartbeat, RequestMessage
from fleet.settings import FleetSettings
from tests.kafka_service import kafka_server
from tests.processes import ROOT, fleet_argv, fleet_env
from tests.services import die_with_parent, free_port, require_binary, wait_port

HANDLER_REF = f"{CountingSleep.__module__}:{CountingSleep.__name__}"
LOG_ROOT = RESULTS_DIR / "chaos"
SERVER_START_S = 30.0
POLL_S = 1.0
PUBLISH_IN_FLIGHT = 128
PUBLISH_ATTEMPT_S = 10.0
STORE_READ_S = 60.0  # the final read waits this long for a store that is still coming back

Fault = Literal["kill-workers", "kill-nats", "kill-redis", "kill-dispatcher", "garbage"]


@dataclass(frozen=True, slots=True)
class Scenario:
    key: str
    title: str
    broker: Literal["nats", "kafka"]
    fault: Fault
    routing: Literal["pull", "dispatch"] = "pull"


SCENARIOS = {
    s.key: s
    for s in (
        Scenario("a", "NATS, workers SIGKILLed", "nats", "kill-workers"),
        Scenario("b", "Kafka, workers SIGKILLed", "kafka", "kill-workers"),
        Scenario("c", "nats-server SIGKILLed", "nats", "kill-nats"),
        Scenario("d", "redis-server SIGKILLed (AOF)", "nats", "kill-redis"),
        Scenario("e", "a dispatcher SIGKILLed", "nats", "kill-dispatcher", "dispatch"),
        Scenario("f", "garbage among good jobs", "nats", "garbage"),
    )
}


class HarnessError(Exception):
    """The harness could not run a scenario (a server or the fleet would not start)."""


# -- servers --------------------------------------------------------------------------------------------------
class Server:
    """A server that can be SIGKILLed and started again on the same port over the same data directory."""

    def __init__(self, name: str, argv: list[str], port: int, workdir: Path, url: str) -> None:
        self.name, self.argv, self.port, self.workdir, self.url = name, argv, port, workdir, url
        self.log = workdir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        self.proc = self._spawn()
        await asyncio.to_thread(wait_port, "127.0.0.1", self.port, self.proc, self.log, SERVER_START_S, self.name)

    def _spawn(self) -> subprocess.Popen[bytes]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:  # appended: a restart keeps the log of the run before
            return subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir, preexec_fn=die_with_parent
            )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def redis_server(workdir: Path) -> Server:
    port = free_port()
    argv = [require_binary("redis-server", "redis-server"), "--port", str(port), "--bind", "127.0.0.1"]
    argv += ["--save", "", "--appendonly", "yes", "--appendfsync", "always", "--dir", str(workdir)]
    return Server("redis-server", argv, port, workdir, f"redis://127.0.0.1:{port}/0")


def nats_server(workdir: Path) -> Server:
    port = free_port()
    argv = [require_binary("nats-server", "nats-server"), "-a", "127.0.0.1", "-p", str(port), "-js"]
    argv += ["-sd", str(workdir / "jetstream")]
    return Server("nats-server", argv, port, workdir, f"nats://127.0.0.1:{port}")


# -- fleet processes ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Member:
    role: Literal["worker", "dispatcher"]
    ident: str
    proc: subprocess.Popen[bytes]
    spawned: float = field(default_factory=time.time)


class Fleet:
    """The scenario's ``fleet worker`` and ``fleet dispatcher`` processes, as a supervisor would run them."""

    def __init__(self, env: dict[str, str], log_dir: Path, routing: str) -> None:
        self.env, self.log_dir, self.routing = env, log_dir, routing
        self.members: list[Member] = []
        self.exits: list[str] = []  # processes that ended by themselves
        self._serial = 0

    def spawn(self, role: Literal["worker", "dispatcher"]) -> Member:
        self._serial += 1
        if role == "worker":
            ident = f"{MODEL}-w{self._serial}"
            argv = ["worker", "--model", HANDLER_REF, "--worker-id", ident, "--routing", self.routing]
        else:
            ident = f"{MODEL}-d{self._serial}"
            argv = ["dispatcher", "--model", MODEL, "--port", "0", "--dispatcher-id", ident]
        with (self.log_dir / f"{ident}.log").open("ab") as out:
            proc = subprocess.Popen(
                fleet_argv(*argv), env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                preexec_fn=die_with_parent,
            )  # fmt: skip
        member = Member(role, ident, proc)
        self.members.append(member)
        return member

    def of(self, role: str) -> list[Member]:
        return [m for m in self.members if m.role == role]

    def kill(self, member: Member) -> None:
        self.members.remove(member)
        if member.proc.poll() is None:
            member.proc.send_signal(signal.SIGKILL)
            member.proc.wait()

    def supervise(self) -> list[str]:
        """Restart members that exited by themselves; returns what happened, for the notes."""
        events = []
        for member in [m for m in self.members if m.proc.poll() is not None]:
            self.members.remove(member)
            events.append(f"{member.ident} exited with {member.proc.returncode}; restarted")
            self.spawn(member.role)
        self.exits += events
        return events

    def stop(self) -> None:
        stop_processes([m.proc for m in self.members], timeout_s=10)
        self.members.clear()


class Beats:
    """The latest worker and dispatcher heartbeats by id, read through the harness's own broker connection."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.workers: dict[str, Heartbeat] = {}
        self.dispatchers: dict[str, DispatcherBeat] = {}

    async def run(self) -> None:
        await asyncio.gather(
            self._follow(c.heartbeat_subject(MODEL), Heartbeat, self.workers, "worker_id"),
            self._follow(c.dispatcher_subject(MODEL), DispatcherBeat, self.dispatchers, "dispatcher_id"),
        )

    async def _follow(self, subject: str, kind: type[BaseModel], into: dict[str, Any], key: str) -> None:
        while True:  # a stream that ends (broker restarted) is opened again
            try:
                stream = await self.broker.listen(subject)
                try:
                    async for beat in validated(stream, kind, subject):
                        into[getattr(beat, key)] = beat
                finally:
                    await stream.close()
            except Exception as exc:  # the broker is down: listen again shortly
                say("-", f"heartbeats on {subject}: {exc!r}; listening again")
            await asyncio.sleep(1)

    def ready(self, member: Member) -> bool:
        beats: dict[str, Any] = self.workers if member.role == "worker" else self.dispatchers
        beat = beats.get(member.ident)
        return beat is not None and beat.state == "ready" and beat.sent_at >= member.spawned


# -- what is published ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Outgoing:
    job_id: str  # for garbage: its marker
    body: bytes
    msg_id: str | None
    good: bool


def good_job(job_id: str, service_ms: float) -> Outgoing:
    body = RequestMessage(job_id=job_id, model=MODEL, input={"job": job_id, "mean_ms": service_ms})
    return Outgoing(job_id, body.model_dump_json().encode(), job_id, True)


def garbage_body(marker: str, kind: int, depth: int) -> bytes:
    """Raw bodies that parsers choke on; every one names its marker so its dead letter can be recognised."""
    head = f'{{"job_id":"{marker}","model":"{MODEL}","input":'
    bodies = [
        f'{head}{{"job":"{marker}","a":{"[" * depth}{"]" * depth}}}}}'.encode(),  # nested `depth` levels
        head.encode() + b'{"job":"\xff\xfe' + marker.encode() + b'"}}',  # invalid UTF-8
        json.dumps([marker, 1, 2]).encode(),  # JSON, not an object
        f'{head}{{"job":"{marker}","mean_ms":1{"0" * 5000}}}}}'.encode(),  # an integer of 5,001 digits
        f'{head}{{"job":"{marker}","mean_ms":1e999}}}}'.encode(),  # a float beyond double range
        f'{{"job_id":"{marker}\\ud800","model":"{MODEL}","input":{{"job":"{marker}"}}}}'.encode(),  # lone surrogate
    ]
    return bodies[kind % len(bodies)]


def plan(key: str, jobs: int, garbage: int, depth: int, service_ms: float) -> list[Outgoing]:
    """Good jobs with the garbage spread evenly among them (the first garbage message comes early)."""
    token = uuid.uuid4().hex[:6]
    items = [good_job(f"{key}-{token}-{i:06d}", service_ms) for i in range(jobs)]
    step = max(1, jobs // max(1, garbage))
    for n in reversed(range(garbage)):
        marker = f"bad-{n:05d}"
        # Half carry a message id, as `fleet publish` would set; half none, as a bare client might send.
        item = Outgoing(marker, garbage_body(marker, n, depth), marker if n % 2 == 0 else None, False)
        items.insert(min(len(items), 5 + n * step), item)
    return items


class Publisher:
    """Publishes at a steady rate; a failed publish is retried with the same message id until the deadline."""

    def __init__(self, broker: Broker, items: list[Outgoing], rate: float, deadline: float) -> None:
        self.broker, self.items, self.rate, self.deadline = broker, items, rate, deadline
        self.acked_good: set[str] = set()
        self.acked_bad: set[str] = set()
        self.retries = 0
        self.errors: Counter[str] = Counter()
        self.done = asyncio.Event()
        self.finished_at: float | None = None

    async def run(self) -> None:
        slots = asyncio.Semaphore(PUBLISH_IN_FLIGHT)
        tasks: set[asyncio.Task[None]] = set()
        start = time.monotonic()
        for i, item in enumerate(self.items):
            await asyncio.sleep(max(0.0, start + i / self.rate - time.monotonic()))
            await slots.acquire()
            if time.monotonic() > self.deadline:
                slots.release()
                break
            task = asyncio.create_task(self._one(item, slots))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
        self.finished_at = time.monotonic()
        self.done.set()

    async def _one(self, item: Outgoing, slots: asyncio.Semaphore) -> None:
        delay_s = 0.1
        try:
            while time.monotonic() < self.deadline:
                try:
                    async with asyncio.timeout(PUBLISH_ATTEMPT_S):
                        await self.broker.publish(c.request_subject(MODEL), item.body, msg_id=item.msg_id)
                except Exception as exc:  # an outage: retry like a producer would
                    self.retries += 1
                    self.errors[type(exc).__name__] += 1
                    await asyncio.sleep(delay_s)
                    delay_s = min(2.0, delay_s * 2)
                    continue
                (self.acked_good if item.good else self.acked_bad).add(item.job_id)
                return
        finally:
            slots.release()


# -- one scenario ---------------------------------------------------------------------------------------------
class Run:
    """One scenario on running servers: start the fleet, publish, inject the fault, watch, tally."""

    def __init__(
        self, sc: Scenario, args: argparse.Namespace, workdir: Path, broker_url: str, redis: Server, nats: Server | None
    ) -> None:
        self.sc, self.args, self.workdir, self.redis, self.nats = sc, args, workdir, redis, nats
        self.settings = FleetSettings(broker_url=broker_url, store_url=redis.url, models=[MODEL])
        self.computed_dir = workdir / "computed"
        self.computed_dir.mkdir(parents=True, exist_ok=True)
        env = fleet_env(
            FLEET_BROKER_URL=broker_url,
            FLEET_STORE_URL=redis.url,
            FLEET_ACK_WAIT_S=str(args.ack_wait_s),
            FLEET_HEARTBEAT_INTERVAL_S="1",
            FLEET_DEVICE="cpu",
            FLEET_LOG_LEVEL="INFO",
        )
        env[COMPUTED_DIR_ENV] = str(self.computed_dir)
        self.fleet = Fleet(env, workdir, sc.routing)
        self.row = Row(sc.key, sc.title)
        self.terminal: set[str] = set()
        self.fault_over = asyncio.Event()

    def note(self, message: str) -> None:
        self.row.notes.append(message)
        say(self.sc.key, message)

    async def execute(self) -> Row:
        broker = make_broker(self.settings)
        await broker.connect()
        store = aioredis.from_url(self.redis.url, socket_timeout=5, socket_connect_timeout=2)
        try:
            await broker.ensure_model(MODEL)
            async with self._observers(broker) as (beats, watcher, letters):
                await self._start_fleet(beats)
                publisher = self._publisher(broker)
                started = time.monotonic()
                try:
                    async with self._background(publisher.run(), self._fault(beats, publisher)):
                        await self._watch(store, publisher, letters, started)
                finally:
                    self.row.seconds = time.monotonic() - started
                    await asyncio.to_thread(self.fleet.stop)  # SIGTERM, up to 10 s to drain; notices still count
                await asyncio.sleep(2)  # the last dead letters and notices arrive
                tally = await self._tally(store, publisher, watcher, letters)
            tally.fill(self.row)
            if watcher.reconnects:
                self.row.notes.append(f"the notice watcher lost its connection {watcher.reconnects}x and reconnected")
            self.row.notes += self.fleet.exits
        finally:
            self.fleet.stop()
            await store.aclose()
            await broker.close()
        return self.row

    @contextlib.asynccontextmanager
    async def _observers(self, broker: Broker) -> AsyncIterator[tuple[Beats, DoneWatcher, DeadLetters]]:
        beats, watcher, letters = Beats(broker), DoneWatcher(self.redis.url), DeadLetters(broker)
        async with self._background(beats.run(), watcher.run(), letters.run()):
            async with asyncio.timeout(30):
                await watcher.subscribed.wait()
            yield beats, watcher, letters

    @contextlib.asynccontextmanager
    async def _background(self, *coros: Any) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(coro) for coro in coros]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for result in results:
                if isinstance(result, Exception):
                    raise HarnessError(f"a background task of the harness failed: {result!r}") from result

    async def _start_fleet(self, beats: Beats) -> None:
        for _ in range(self.args.workers):
            self.fleet.spawn("worker")
        if self.sc.routing == "dispatch":
            for _ in range(2):
                self.fleet.spawn("dispatcher")
        say(self.sc.key, f"started {len(self.fleet.members)} fleet processes; waiting until they are ready")
        started = time.monotonic()
        deadline = started + self.args.startup_s
        while not all(beats.ready(m) for m in self.fleet.members) or not self._dispatchers_see_workers(beats):
            for event in self.fleet.supervise():
                say(self.sc.key, event)
            if time.monotonic() > deadline:
                raise HarnessError(f"the fleet was not ready within {self.args.startup_s}s; logs in {self.workdir}")
            await asyncio.sleep(0.5)
        say(self.sc.key, f"fleet ready in {time.monotonic() - started:.1f}s; publishing")

    def _dispatchers_see_workers(self, beats: Beats) -> bool:
        dispatchers = [beats.dispatchers.get(m.ident) for m in self.fleet.of("dispatcher")]
        return all(d is not None and d.live_workers >= self.args.workers for d in dispatchers)

    def _publisher(self, broker: Broker) -> Publisher:
        a = self.args
        garbage = a.garbage if self.sc.fault == "garbage" else 0
        items = plan(self.sc.key, a.jobs, garbage, a.depth, a.service_ms)
        deadline = time.monotonic() + len(items) / a.rate + a.grace_s
        return Publisher(broker, items, a.rate, deadline)

    async def _fault(self, beats: Beats, publisher: Publisher) -> None:
        """Inject the scenario's fault; ``fault_over`` is set once a one-off fault is repaired."""
        fault = self.sc.fault
        if fault in ("kill-nats", "kill-redis", "kill-dispatcher"):
            await self._until_published(publisher, self.args.fault_at)
            await self._restart(fault)
        self.fault_over.set()
        if fault == "kill-workers":
            await self._kill_workers(beats)

    async def _kill_workers(self, beats: Beats) -> None:
        """Every period, SIGKILL the longest-running ready worker and start a new one; with ``--kill-last`` off
        (the default) the last ready worker is spared, so the fleet keeps serving while replacements start."""
        kills = spared = 0
        try:
            while True:
                await asyncio.sleep(self.args.kill_every_s)
                ready = [m for m in self.fleet.of("worker") if beats.ready(m)]
                if not ready or (len(ready) == 1 and not self.args.kill_last):
                    spared += 1
                    continue
                self.fleet.kill(min(ready, key=lambda m: m.spawned))
                self.fleet.spawn("worker")
                kills += 1
        finally:
            self.row.notes.append(f"{kills} workers SIGKILLed and replaced; {spared} periods without a kill")

    async def _until_published(self, publisher: Publisher, fraction: float) -> None:
        while len(publisher.acked_good) < fraction * self.args.jobs and not publisher.done.is_set():  # noqa: ASYNC110 - polled
            await asyncio.sleep(0.1)

    async def _restart(self, fault: Fault) -> None:
        if fault == "kill-dispatcher":
            victim = self.fleet.of("dispatcher")[0]
            self.fleet.kill(victim)
            self.note(f"SIGKILLed dispatcher {victim.ident}")
            await asyncio.sleep(self.args.down_s)
            self.note(f"started dispatcher {self.fleet.spawn('dispatcher').ident}")
            return
        server = self.redis if fault == "kill-redis" else self.nats
        if server is None:
            raise HarnessError(f"scenario {self.sc.key} has no server to kill for {fault}")
        server.kill()
        self.note(f"SIGKILLed {server.name}")
        try:
            await asyncio.sleep(self.args.down_s)
        finally:  # also when the scenario ends meanwhile: the records are read back from this server
            await server.start()
        self.note(f"restarted {server.name} on port {server.port} after {self.args.down_s:g}s")

    async def _watch(self, store: aioredis.Redis, publisher: Publisher, letters: DeadLetters, started: float) -> None:
        """Until every published job is terminal (and every garbage message dead-lettered), or the deadline."""
        last_progress = started
        while True:
            await asyncio.sleep(POLL_S)
            for event in self.fleet.supervise():
                say(self.sc.key, event)
            reachable = await self._refresh_terminal(store, publisher)
            now = time.monotonic()
            if self._finished(publisher, letters):
                return
            if publisher.done.is_set() and now > (publisher.finished_at or now) + self.args.grace_s:
                self.note(f"deadline: {len(publisher.acked_good) - len(self.terminal)} published jobs not terminal")
                return
            if now - last_progress >= self.args.progress_s:
                last_progress = now
                self._progress(now - started, publisher, letters, reachable)

    def _finished(self, publisher: Publisher, letters: DeadLetters) -> bool:
        """Everything published is settled: jobs terminal, garbage dead-lettered, the fault repaired."""
        garbage_done = all(letters.by_marker[m] for m in publisher.acked_bad)
        quiet = publisher.done.is_set() and self.fault_over.is_set()
        return quiet and garbage_done and self.terminal >= publisher.acked_good

    async def _refresh_terminal(self, store: aioredis.Redis, publisher: Publisher) -> bool:
        pending = [j for j in publisher.acked_good if j not in self.terminal]
        try:
            records = await read_records(store, pending)
        except (RedisError, OSError):
            return False
        self.terminal.update(j for j, r in records.items() if r is not None and r.get("state") in TERMINAL)
        return True

    def _progress(self, elapsed: float, publisher: Publisher, letters: DeadLetters, reachable: bool) -> None:
        published, done = len(publisher.acked_good), len(self.terminal)
        pct = 100 * done / published if published else 0.0
        line = f"{elapsed:5.0f}s published {published}/{self.args.jobs}, terminal {done} ({pct:.0f} %)"
        if publisher.acked_bad:
            line += f", garbage dead-lettered {sum(1 for m in publisher.acked_bad if letters.by_marker[m])}"
            line += f"/{len(publisher.acked_bad)}"
        if publisher.retries:
            line += f", publish retries {publisher.retries}"
        say(self.sc.key, line + ("" if reachable else ", store unreachable"))

    async def _tally(
        self, store: aioredis.Redis, publisher: Publisher, watcher: DoneWatcher, letters: DeadLetters
    ) -> Tally:
        ids = [item.job_id for item in publisher.items]
        deadline = time.monotonic() + STORE_READ_S
        while True:
            try:
                records = await read_records(store, ids)
                break
            except (RedisError, OSError) as exc:
                if time.monotonic() > deadline:
                    raise HarnessError(f"could not read the records back: {exc!r}") from exc
                await asyncio.sleep(1)
        if publisher.retries:
            errors = ", ".join(f"{k} {n}" for k, n in publisher.errors.most_common())
            self.row.notes.append(f"{publisher.retries} publishes retried ({errors})")
        return Tally(
            good=[i.job_id for i in publisher.items if i.good],
            published=set(publisher.acked_good),
            garbage_published=set(publisher.acked_bad),
            records=records,
            notices=dict(watcher.notices),
            computed=read_computed(self.computed_dir),
            letters=letters,
        )


@contextlib.contextmanager
def scenario_dir(key: str) -> Iterator[Path]:
    workdir = LOG_ROOT / key
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    yield workdir


async def run_scenario(sc: Scenario, args: argparse.Namespace, kafka_url: Callable[[], str]) -> Row:
    say(sc.key, f"scenario {sc.key}: {sc.title}")
    with scenario_dir(sc.key) as workdir:
        redis = redis_server(workdir / "redis")
        nats = nats_server(workdir / "nats") if sc.broker == "nats" else None
        try:
            await redis.start()
            if nats is not None:
                await nats.start()
            run = Run(sc, args, workdir, nats.url if nats is not None else kafka_url(), redis, nats)
            return await run.execute()
        except Exception as exc:  # the harness failed on this scenario: say so in its row, run the others
            say(sc.key, f"harness error: {exc!r}; logs in {workdir}")
            return Row(sc.key, sc.title, error=f"{type(exc).__name__}: {exc}"[:300])
        finally:
            for server in (nats, redis):
                if server is not None:
                    server.stop()


# -- report ---------------------------------------------------------------------------------------------------
WIDTH = 190  # the table's width when stdout is not a terminal (a log file)
DEFECTS = ("lost", "second_terminals", "after_stored", "healthy_failed", "no_notice")
COLUMNS = [
    ("published", "published"),
    ("lost", "lost"),
    ("second_terminals", "2nd terminal"),
    ("computed_twice", "computed 2x"),
    ("after_stored", "after stored"),
    ("healthy_failed", "healthy failed"),
    ("no_notice", "no notice"),
]


def show(rows: list[Row]) -> None:
    out = Console(width=max(WIDTH, shutil.get_terminal_size((WIDTH, 40)).columns), highlight=False)
    table = Table(title="Fleet under faults (benchmarks.chaos)")
    table.add_column("scenario", no_wrap=True)
    for _, title in COLUMNS:
        table.add_column(title, justify="right")
    for title in ("garbage DLQ", "dead letters", "time s"):
        table.add_column(title, justify="right")
    for row in rows:
        if row.error:
            table.add_row(f"{row.key}. {row.title}", f"[red]harness error: {row.error}[/]")
            continue
        cells = [_cell(row, name) for name, _ in COLUMNS]
        garbage = _garbage_cell(row)
        table.add_row(f"{row.key}. {row.title}", *cells, garbage, str(row.dead_letters), f"{row.seconds:.0f}")
    out.print(table)
    for row in rows:
        for note in row.notes:
            out.print(f"  {row.key}: {note}", markup=False)
    for row in rows:
        nonzero = [f"{title} {getattr(row, name)}" for name, title in COLUMNS[1:] if getattr(row, name)]
        if row.garbage and row.garbage_dead_lettered < row.garbage:
            nonzero.append(f"garbage not dead-lettered {row.garbage - row.garbage_dead_lettered}")
        if not row.error:
            out.print(f"{row.key}: " + ("[bold red]NON-ZERO: " + ", ".join(nonzero) + "[/]" if nonzero else "all zero"))


def headlines(rows: list[Row]) -> list[tuple[str, str, str]]:
    """One row per scenario for the result file: its defects summed (target 0), or its harness error."""
    out = []
    for row in rows:
        if row.error:
            out.append((f"{row.key}. {row.title}", f"harness error: {row.error}", "== 0"))
            continue
        defects = sum(getattr(row, name) for name in DEFECTS)
        if row.garbage:
            defects += row.garbage - row.garbage_dead_lettered
        out.append((f"{row.key}. {row.title}: defects", str(defects), "== 0"))
        out.append((f"{row.key}. {row.title}: computed twice", str(row.computed_twice), ""))
    return out


def _cell(row: Row, name: str) -> str:
    value = getattr(row, name)
    return f"[bold red]{value}[/]" if value and name in DEFECTS else str(value)


def _garbage_cell(row: Row) -> str:
    if not row.garbage:
        return "-"
    text = f"{row.garbage_dead_lettered}/{row.garbage}"
    return text if row.garbage_dead_lettered == row.garbage else f"[bold red]{text}[/]"


# -- command line ---------------------------------------------------------------------------------------------
FULL = {"jobs": 10_000, "rate": 250.0, "garbage": 200, "grace_s": 240.0}
QUICK = {"jobs": 1_000, "rate": 100.0, "garbage": 40, "grace_s": 60.0}


def scenario_list(value: str) -> list[str]:
    keys = [k.strip() for k in value.split(",") if k.strip()]
    unknown = sorted(set(keys) - set(SCENARIOS))
    if unknown or not keys:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(SCENARIOS)}, got {value!r}")
    return list(dict.fromkeys(keys))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", type=scenario_list, default=list(SCENARIOS), help="e.g. a,c (default: all)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1,000 jobs at 100/s, 40 garbage, 60 s grace")
    p.add_argument("--jobs", type=int, help="good jobs per scenario (default 10,000)")
    p.add_argument("--rate", type=float, help="publishes per second (default 250)")
    p.add_argument("--garbage", type=int, help="garbage messages in scenario f (default 200)")
    p.add_argument("--grace-s", type=float, help="how long after the last publish a scenario may run (default 240)")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--kill-every-s", type=float, default=3.0, help="a and b: period of the worker kills")
    p.add_argument(
        "--kill-last", action="store_true", help="a and b: also kill the last ready worker (none serves meanwhile)"
    )
    p.add_argument("--fault-at", type=float, default=0.5, help="c, d, e: the fraction published when it hits")
    p.add_argument("--down-s", type=float, default=5.0, help="c, d, e: how long the killed process stays down")
    p.add_argument("--depth", type=int, default=1000, help="f: nesting depth of the deep JSON body")
    p.add_argument("--service-ms", type=float, default=2.0, help="fixed service time of one job")
    p.add_argument("--ack-wait-s", type=float, default=10.0, help="FLEET_ACK_WAIT_S of the fleet processes")
    p.add_argument("--startup-s", type=float, default=180.0, help="longest wait for the fleet to be ready")
    p.add_argument("--progress-s", type=float, default=5.0, help="how often progress is printed (stderr)")
    args = p.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.jobs < 1 or args.rate <= 0 or args.workers < 1 or not 0 <= args.fault_at <= 1:
        p.error("--jobs and --workers must be >= 1, --rate > 0 and --fault-at within 0..1")
    return args


async def main(args: argparse.Namespace) -> int:
    # Warnings of the harness's own broker client (say, while nats-server is down) go to stderr with the progress.
    logging.basicConfig(level=logging.WARNING, format="[-] %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        kafka: list[str] = []

        def kafka_url() -> str:  # started on first use, shared by the Kafka scenarios
            if not kafka:
                say("b", "starting Kafka (20-40 s)")
                kafka.append(stack.enter_context(kafka_server()))
            return kafka[0]

        for key in args.scenarios:
            rows.append(await run_scenario(SCENARIOS[key], args, kafka_url))
    show(rows)
    record("defects per scenario (lost, 2nd terminal, after stored, healthy failed, no notice)", headlines(rows))
    path = write_result("chaos", {"params": vars(args), "rows": [asdict(r) for r in rows]})
    print(f"wrote {path}")
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
