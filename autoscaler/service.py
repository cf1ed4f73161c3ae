"""The autoscaler loop: signals -> policy -> backend, under a lock so that only one autoscaler acts.

Every ``interval_s`` the autoscaler takes or renews the lock in the scaling store. A standby (the lock is held by
another owner) keeps following the heartbeats, so it has warm signals when it takes over, but decides nothing.
The holder, for each model: applies the operator's overrides (``PUT /v1/scaling/{model}``) on top of the model's
``ScalingConfig``, reads the signals, calls the pure policy (or, while an operator's scale-to-N override is in
force, holds its replica count until its expiry, with a decision saying so; after it the policy applies again),
asks the backend for the new replica count when it changed, stores the decision with its inputs and reason
(every change, and a no-change one at least every ``record_every_s`` or when the recommendation moves), stores
the model's status for ``GET /v1/scaling``, and sets the Prometheus gauges. An error in one model's step is
logged and the next tick tries again.

A **pool** (``pools``: a target name and the models its multi-model workers serve) is one target like a model: its
signals are the sum of its models' demand (``fleet.autoscaler.pools``), its replicas are pool workers, and its
status lists each model's part (``ScalingStatus.pool``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from prometheus_client import Gauge

from fleet import constants as c
from fleet.autoscaler.backends.base import ScalerBackend
from fleet.autoscaler.config import ScalingConfig
from fleet.autoscaler.policy import Decision, PolicyState, Signals, decide, pinned
from fleet.autoscaler.pools import describe, pool_signals
from fleet.autoscaler.signals import SignalReader
from fleet.brokers.base import Broker
from fleet.errors import FleetError
from fleet.scaling import ScalingStore
from fleet.schemas.scaling import DecisionRecord, PoolMember, ScalingOverrides, ScalingStatus
from fleet.tasks import cancel_and_wait, wait_event

log = logging.getLogger(__name__)

LAG = Gauge(
    "fleet_autoscaler_lag", "Requests not yet finished (waiting + in flight), as the autoscaler read it", ["model"]
)
ARRIVAL_RATE = Gauge(
    "fleet_autoscaler_arrival_rate", "Requests per second arriving, as the autoscaler estimates", ["model"]
)
CURRENT_REPLICAS = Gauge(
    "fleet_autoscaler_current_replicas", "Worker replicas running after the last decision", ["model"]
)
DESIRED_REPLICAS = Gauge(
    "fleet_autoscaler_desired_replicas", "Replicas the signals ask for, within min/max (before smoothing)", ["model"]
)
QUEUE_AGE = Gauge(
    "fleet_autoscaler_queue_age_seconds",
    "Seconds the oldest request not yet finished has waited (0: none waits), as the autoscaler read it",
    ["model"],
)
RECORD_EVERY_S = 30.0


def default_owner_id() -> str:
    """``host-pid-random``: unique per autoscaler process, readable in the lock and the decisions."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(slots=True)
class _Recorded:
    at_s: float
    desired: int
    paused: bool
    pinned_until: float | None = None


def _until_text(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


class Autoscaler:
    """Scales each model in ``configs`` through ``backend``. ``async with`` (or start/stop) runs the loop.

    Args:
        broker: a connected broker (lag, heartbeats).
        scaling_store: a connected ``ScalingStore`` (lock, overrides, decisions, status).
        backend: what changes the replica counts; closed (workers drained) by ``stop``.
        configs: per model name (or pool name), its validated ``ScalingConfig``.
        interval_s: seconds between decisions.
        owner_id: this autoscaler's id in the lock and the decisions (default: host, pid and a random suffix).
        lock_ttl_s: the lock lapses this long after the holder's last renewal (default: three intervals, >= 5s),
            which is how long a standby waits to take over from a holder that died.
        heartbeat_interval_s: the workers' heartbeat interval (a worker silent for three is gone).
        partitions: the request topics' partition count on Kafka (caps the replicas).
        signals: a ``SignalReader`` to use instead of one built from the arguments above.
        record_every_s: store a no-change decision at least this often.
        clock: monotonic seconds (the policy's clock).
        wall_clock: unix seconds (the expiry of a scale-to-N override).
        pools: per pool name in ``configs``, the names of the models its workers serve (``fleet.pools.members``);
            a pool is scaled on their summed demand.
    """

    def __init__(
        self,
        broker: Broker,
        scaling_store: ScalingStore,
        backend: ScalerBackend,
        configs: Mapping[str, ScalingConfig],
        interval_s: float = c.DEFAULT_AUTOSCALER_INTERVAL_S,
        owner_id: str | None = None,
        *,
        lock_ttl_s: float | None = None,
        heartbeat_interval_s: float = c.DEFAULT_HEARTBEAT_INTERVAL_S,
        partitions: int | None = None,
        signals: SignalReader | None = None,
        record_every_s: float = RECORD_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        pools: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.broker = broker
        self.store = scaling_store
        self.backend = backend
        self.configs = dict(configs)
        self.pools = {pool: tuple(models) for pool, models in (pools or {}).items()}
        unconfigured = sorted(set(self.pools) - set(self.configs))
        if unconfigured or any(not models for models in self.pools.values()):
            raise ValueError(f"every pool needs a scaling config and at least one model: {unconfigured or self.pools}")
        self.interval_s = interval_s
        self.owner_id = owner_id or default_owner_id()
        self.lock_ttl_s = lock_ttl_s if lock_ttl_s is not None else max(3 * interval_s, 5.0)
        self.signals = signals or SignalReader(
            broker, heartbeat_interval_s=heartbeat_interval_s, partitions=partitions, clock=clock
        )
        self.record_every_s = record_every_s
        self.clock = clock
        self.wall_clock = wall_clock
        self.leader = False
        self.ticks = 0
        self._policy: dict[str, PolicyState] = {}
        self._recorded: dict[str, _Recorded] = {}
        self._override_problems: dict[str, str] = {}
        self._pinned: dict[str, float] = {}  # model -> expiry of the scale-to-N override in force at its last step
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._started = False
        self._stopped = False

    # -- lifecycle ------------------------------------------------------------------------------------------
    async def __aenter__(self) -> Autoscaler:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Follow the heartbeats and start the loop (its first tick runs at once)."""
        if self._started:
            return
        self._started = True
        await self.signals.start()
        self._task = asyncio.create_task(self._run(), name=f"autoscaler-{self.owner_id}")
        log.info(
            "autoscaler %s: scaling %s with the %s backend every %.1fs",
            self.owner_id,
            ", ".join(self.configs),
            self.backend.name,
            self.interval_s,
        )

    async def stop(self) -> None:
        """Stop deciding, release the lock, close the backend (its workers drain), stop listening. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if self._task is not None:
            await cancel_and_wait([self._task], timeout_s=max(5.0, 2 * self.interval_s))
        if self.leader:
            try:
                await self.store.release(self.owner_id)
            except Exception as exc:
                log.warning(
                    "autoscaler %s: lock not released (it lapses after %.1fs): %s", self.owner_id, self.lock_ttl_s, exc
                )
            self.leader = False
        try:
            await self.backend.close()
        except Exception:
            log.exception("autoscaler %s: closing the %s backend failed", self.owner_id, self.backend.name)
        await self.signals.stop()
        log.info("autoscaler %s stopped after %d ticks", self.owner_id, self.ticks)

    async def _run(self) -> None:
        while not self._stop.is_set():
            try:
                await self.tick()
            except Exception:
                log.exception("autoscaler %s: tick failed; trying again in %.1fs", self.owner_id, self.interval_s)
            await wait_event(self._stop, self.interval_s)

    # -- one tick -------------------------------------------------------------------------------------------
    async def tick(self) -> dict[str, Decision]:
        """Take or renew the lock and, when this autoscaler holds it, decide for every model.

        Returns the decisions made (empty for a standby). Errors of one model are logged; the others go on.
        """
        self.ticks += 1
        if not await self._lead():
            return {}
        decisions: dict[str, Decision] = {}
        for model, config in self.configs.items():
            try:
                decisions[model] = await self.scale(model, config)
            except FleetError as exc:
                log.warning("autoscaler %s: scaling %s failed (next tick retries): %s", self.owner_id, model, exc)
            except Exception:
                log.exception("autoscaler %s: scaling %s failed; trying again next tick", self.owner_id, model)
        return decisions

    async def _lead(self) -> bool:
        try:
            holder = await self.store.acquire(self.owner_id, self.lock_ttl_s)
        except Exception as exc:
            holder = False  # cannot prove we hold it: act as a standby until the store answers again
            log.warning("autoscaler %s: lock not renewed: %s", self.owner_id, exc)
        if holder != self.leader or self.ticks == 1:
            role = "the active autoscaler" if holder else "on standby (another autoscaler holds the lock)"
            log.info("autoscaler %s: now %s", self.owner_id, role)
            self.leader = holder
        return holder

    async def scale(self, model: str, base: ScalingConfig) -> Decision:
        """One model's step: overrides, signals, policy (or the scale-to-N override in force), backend, record,
        status, gauges."""
        overrides = await self.store.get_overrides(model)
        config = self._effective_config(model, base, overrides)
        current = await self.backend.current_replicas(model)
        members = await self._members(model, current)
        signals = (
            await self.signals.read(model, current)
            if members is None
            else pool_signals(members, current, config.target_drain_s)
        )
        before = self._policy.get(model, PolicyState())
        decision, state = decide(signals, config, before, self.clock())
        if members is not None:
            decision = dataclasses.replace(decision, reason=f"{decision.reason} (pool of {describe(members)})")
        pin = overrides.pin(self.wall_clock())
        if pin is not None:
            decision, state = pinned(signals, pin.replicas, _until_text(pin.until), decision), before
            self._pinned[model] = pin.until
        elif self._pinned.pop(model, None) is not None:
            decision = dataclasses.replace(decision, reason=f"scale-to-N ended; {decision.reason}")
        if decision.replicas != current:
            await self.backend.set_replicas(model, decision.replicas)
        self._policy[model] = state  # after the backend took the change: a failed one is not rate-limited next
        running = decision.replicas
        desired = decision.desired if pin else _within(decision.desired, config, signals.partitions)
        if decision.changed:
            log.info("autoscaler: %s %s", model, decision.reason)
        await self._maybe_record(model, signals, decision, desired, config.paused, pin.until if pin else None)
        status = self._status(model, config, signals, decision, running, desired)
        status.pinned = pin
        if members is not None:
            status.pool = [
                PoolMember(
                    model=m, lag=s.lag, arrival_rate=s.arrival_rate, throughput_per_replica=s.throughput_per_replica
                )
                for m, s in members.items()
            ]
            status.completion_rate = self.signals.completion_rate_of(list(members))
            status.live_workers = self.signals.live_workers_of(list(members))
        own = ScalingOverrides(min_replicas=base.min_replicas, max_replicas=base.max_replicas, paused=base.paused)
        await self.store.put_status(status.model_copy(update={"configured": own}))
        _set_gauges(model, signals, running, desired)
        return decision

    async def _members(self, target: str, current: int) -> dict[str, Signals] | None:
        """Each model's signals when ``target`` is a pool (read in turn, like the models of a tick); else None."""
        models = self.pools.get(target)
        if models is None:
            return None
        return {model: await self.signals.read(model, current) for model in models}

    def _effective_config(self, model: str, base: ScalingConfig, overrides: ScalingOverrides) -> ScalingConfig:
        changes = overrides.limits()
        if not changes:
            self._override_problems.pop(model, None)
            return base
        try:
            config = base.with_changes(**changes)
        except ValueError as exc:
            self._warn_override(model, overrides, exc)
            return base.with_changes(paused=overrides.paused) if overrides.paused is not None else base
        self._override_problems.pop(model, None)
        return config

    def _warn_override(self, model: str, overrides: ScalingOverrides, exc: ValueError) -> None:
        problem = str(exc)
        if self._override_problems.get(model) != problem:
            self._override_problems[model] = problem
            log.warning(
                "autoscaler: overrides %s of %s conflict with its configuration; ignoring min/max: %s",
                overrides.model_dump(exclude_none=True),
                model,
                problem,
            )

    async def _maybe_record(
        self, model: str, signals: Signals, decision: Decision, desired: int, paused: bool, pinned_until: float | None
    ) -> None:
        now_s = self.clock()
        last = self._recorded.get(model)
        due = (
            last is None
            or decision.changed
            or last.desired != desired
            or last.paused != paused
            or last.pinned_until != pinned_until
            or now_s - last.at_s >= self.record_every_s
        )
        if not due:
            return
        await self.store.record(
            DecisionRecord(
                at=time.time(),
                model=model,
                current_replicas=signals.current_replicas,
                desired_replicas=decision.desired,
                replicas=decision.replicas,
                lag=signals.lag,
                arrival_rate=signals.arrival_rate,
                throughput_per_replica=signals.throughput_per_replica,
                reason=decision.reason,
                changed=decision.changed,
                owner=self.owner_id,
            )
        )
        self._recorded[model] = _Recorded(now_s, desired, paused, pinned_until)

    def _status(
        self, model: str, config: ScalingConfig, signals: Signals, decision: Decision, running: int, desired: int
    ) -> ScalingStatus:
        return ScalingStatus(
            model=model,
            current_replicas=running,
            desired_replicas=desired,
            lag=signals.lag,
            arrival_rate=signals.arrival_rate,
            queue_age_s=signals.queue_age_s,
            min_replicas=config.min_replicas,
            max_replicas=config.max_replicas,
            paused=config.paused,
            backend=self.backend.name,
            updated_at=time.time(),
            throughput_per_replica=signals.throughput_per_replica,
            completion_rate=self.signals.completion_rate(model),
            live_workers=self.signals.live_workers(model),
            reason=decision.reason,
            wanted_replicas=decision.desired,
        )


def _within(desired: int, config: ScalingConfig, partitions: int | None) -> int:
    """The recommendation within min/max and the partition cap (what the fleet heads for)."""
    bounded = min(max(desired, config.min_replicas), config.max_replicas)
    return min(bounded, partitions) if partitions else bounded


def _set_gauges(model: str, signals: Signals, running: int, desired: int) -> None:
    if signals.lag is not None:
        LAG.labels(model).set(signals.lag)
    if signals.arrival_rate is not None:
        ARRIVAL_RATE.labels(model).set(signals.arrival_rate)
    QUEUE_AGE.labels(model).set(signals.queue_age_s or 0.0)
    CURRENT_REPLICAS.labels(model).set(running)
    DESIRED_REPLICAS.labels(model).set(desired)
