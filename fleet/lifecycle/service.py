"""The rollout controller's loop: measurements -> ``controller.decide`` and ``breaker_counts.judge`` -> the model's
traffic policy, under a lock so that one controller acts per Redis.

Every ``interval_s`` the service takes or renews the lock (``RolloutStore.acquire_lock``); a standby decides nothing.
The holder, for each model with a ``RolloutDoc`` (``RolloutStore.models``), in one step:

1. reads the document and, for each version the policy names (primary, canary, shadow), its window of the last
   ``window_s`` (requests, failures, p99, shadow agreement) and its running tally;
2. judges each version's breaker from its tally (``breaker_counts.judge``);
3. with a canary and a ``rollout`` config, calls ``decide`` on the primary's and the canary's windows (the
   agreement is the canary's own: the comparisons recorded while it was, or is, mirrored as the shadow) and, when
   the weight moves, ``apply``s the decision to the policy;
4. when a breaker changed state, the weight moved or the controller's phase or step changed, writes the document
   back by compare-and-set on the revision it read (another writer first: read again and redo, up to
   ``CAS_ATTEMPTS`` times; the next tick tries again after that);
5. only after the write, appends a ``DecisionEntry`` per change to the model's timeline, and sets the gauges.

Holds are not written each tick: a hold goes on the timeline when its reason (numbers aside) differs from the
model's last hold, so "holding canary at 5 %: too few samples" appears once, not every ``interval_s``. The
baseline the controller learns from the primary each tick is kept in memory with the revision it belongs to and
written with the next change; a controller that takes over starts from the last written one. A crash between the
write and the timeline loses the entry, never the decision.

``manual(doc, action, by, now)`` is a person's promote or rollback (``controller.override``), carried out at once by
``POST /v1/models/{name}/promote`` and ``/rollback`` with the same write.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from prometheus_client import Counter, Gauge

from fleet import constants as c
from fleet.errors import FleetError
from fleet.lifecycle.breaker import BreakerState
from fleet.lifecycle.breaker_counts import Tally, judge
from fleet.lifecycle.controller import (
    Decision,
    Observation,
    RolloutConfig,
    RolloutState,
    VersionStats,
    apply,
    decide,
    override,
)
from fleet.lifecycle.traffic import TrafficPolicy
from fleet.store.rollouts import DecisionEntry, RolloutDoc, RolloutStore, WindowStats
from fleet.tasks import cancel_and_wait, wait_event

log = logging.getLogger(__name__)

CAS_ATTEMPTS = 5
BREAKER_VALUES = {"closed": 0, "half_open": 1, "open": 2}
ENTRY_ACTIONS = {"step_up": "step", "promote": "promote", "roll_back": "roll_back", "hold": "hold"}

CANARY_WEIGHT = Gauge("fleet_rollout_canary_weight", "The canary's share of a model's requests", ["model"])
BREAKER_STATE = Gauge(
    "fleet_rollout_breaker_state",
    "A model version's circuit breaker: 0 closed, 1 half-open, 2 open",
    ["model", "version"],
)
DECISIONS = Counter(
    "fleet_rollout_decisions",
    "Changes the rollout controller made, by action (step, promote, roll_back, breaker)",
    ["model", "action"],
)


def default_owner_id() -> str:
    """``host-pid-random``: unique per controller process, readable in the lock."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def versions_of(policy: TrafficPolicy) -> list[str]:
    """The versions a policy names: primary, then canary and shadow when set."""
    return [v for v in (policy.primary, policy.canary, policy.shadow) if v is not None]


@dataclass(frozen=True, slots=True)
class Step:
    """What one model's step did: the controller's decision (None without a canary or a rollout config), the
    breakers that changed state, and whether the document was written."""

    decision: Decision | None
    breakers: dict[str, BreakerState]
    written: bool


class RolloutService:
    """Judges every model's canary and breakers each ``interval_s``. ``async with`` (or start/stop) runs the loop.

    Args:
        rollouts: a connected ``RolloutStore`` (documents, measurements, timeline, lock).
        interval_s: seconds between ticks.
        window_s: the window of measurements a canary is judged on.
        owner_id: this controller's id in the lock (default: host, pid and a random suffix).
        lock_ttl_s: the lock lapses this long after the holder's last renewal (default: three intervals, >= 5 s).
        clock: unix seconds (the controller's and the breakers' clock, shared through the documents).
    """

    def __init__(
        self,
        rollouts: RolloutStore,
        *,
        interval_s: float = c.DEFAULT_ROLLOUT_INTERVAL_S,
        window_s: float = c.DEFAULT_ROLLOUT_WINDOW_S,
        owner_id: str | None = None,
        lock_ttl_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if interval_s <= 0 or window_s <= 0:
            raise ValueError(f"interval_s and window_s must be positive, got {interval_s} and {window_s}")
        self.rollouts = rollouts
        self.interval_s = interval_s
        self.window_s = window_s
        self.owner_id = owner_id or default_owner_id()
        self.lock_ttl_s = lock_ttl_s if lock_ttl_s is not None else max(3 * interval_s, 5.0)
        self.clock = clock
        self.leader = False
        self.ticks = 0
        self._states: dict[str, tuple[int, RolloutState]] = {}  # model -> (revision, state with a fresher baseline)
        self._breakers: dict[tuple[str, str], BreakerState] = {}  # (model, version) -> state with its window
        self._tallies: dict[tuple[str, str], Tally] = {}  # (model, version) -> the tally at the previous tick
        self._last_hold: dict[str, str] = {}  # model -> the last hold put on its timeline (numbers aside)
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._started = False
        self._stopped = False

    # -- lifecycle ------------------------------------------------------------------------------------------
    async def __aenter__(self) -> RolloutService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start the loop (its first tick runs at once)."""
        if self._started:
            return
        self._started = True
        self._task = asyncio.create_task(self._run(), name=f"rollouts-{self.owner_id}")
        log.info(
            "rollout controller %s: judging every %.1fs on %.0fs windows", self.owner_id, self.interval_s, self.window_s
        )

    async def stop(self) -> None:
        """Stop deciding and release the lock. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if self._task is not None:
            await cancel_and_wait([self._task], timeout_s=max(5.0, 2 * self.interval_s))
        if self.leader:
            try:
                await self.rollouts.release_lock(self.owner_id)
            except Exception as exc:
                log.warning("rollout controller %s: lock not released (it lapses): %s", self.owner_id, exc)
            self.leader = False

    async def _run(self) -> None:
        while not self._stop.is_set():
            try:
                await self.tick()
            except Exception:
                log.exception(
                    "rollout controller %s: tick failed; trying again in %.1fs", self.owner_id, self.interval_s
                )
            await wait_event(self._stop, self.interval_s)

    # -- one tick -------------------------------------------------------------------------------------------
    async def tick(self) -> dict[str, Step]:
        """Take or renew the lock and, when held, step every model. Errors of one model are logged; the others go
        on. Returns each stepped model's ``Step`` (empty for a standby)."""
        self.ticks += 1
        if not await self._lead():
            return {}
        steps: dict[str, Step] = {}
        try:
            models = await self.rollouts.models()
        except FleetError as exc:  # an outage: one line a tick, not a traceback
            log.warning("rollout controller: models not listed (next tick retries): %s", exc)
            return steps
        for model in models:
            try:
                step = await self.step(model)
            except FleetError as exc:
                log.warning("rollout controller: %s not judged (next tick retries): %s", model, exc)
                continue
            except Exception:
                log.exception("rollout controller: %s not judged; trying again next tick", model)
                continue
            if step is not None:
                steps[model] = step
        return steps

    async def _lead(self) -> bool:
        try:
            holder = await self.rollouts.acquire_lock(self.owner_id, self.lock_ttl_s)
        except Exception as exc:
            holder = False  # cannot prove we hold it: act as a standby until the store answers again
            log.warning("rollout controller %s: lock not renewed: %s", self.owner_id, exc)
        if holder != self.leader or self.ticks == 1:
            role = "the active rollout controller" if holder else "on standby (another controller holds the lock)"
            log.info("rollout controller %s: now %s", self.owner_id, role)
            self.leader = holder
        return holder

    async def step(self, model: str) -> Step | None:
        """One model's step (see the module docstring); None when the model has no document."""
        for _ in range(CAS_ATTEMPTS):
            doc = await self.rollouts.read(model)
            if doc is None:
                self._forget(model)
                return None
            done = await self._try(doc)
            if done is not None:
                return done
        log.info("rollout controller: %s changed under %d attempts; next tick", model, CAS_ATTEMPTS)
        return Step(None, {}, False)

    async def _try(self, doc: RolloutDoc) -> Step | None:
        """Judge ``doc`` and write the changes; None when another writer got there first."""
        model, now = doc.model, self.clock()
        versions = versions_of(doc.policy)
        stats = await self.rollouts.window(model, versions, self.window_s, now)
        tallies = await self.rollouts.tally(model, versions)
        judged = {v: self._judged(doc, v, tallies[v], now) for v in versions}
        moved = {v: s for v, s in judged.items() if s.status != doc.breakers.get(v, BreakerState()).status}
        decision, state = self._decide(doc, stats, now)
        policy = apply(doc.policy, decision) if decision is not None and decision.action != "hold" else doc.policy
        breakers = {**doc.breakers, **{v: _stored(s) for v, s in moved.items()}}
        breakers = {v: s for v, s in breakers.items() if v in versions_of(policy)}
        changed = (
            bool(moved) or policy != doc.policy or breakers != doc.breakers or _progress(state) != _progress(doc.state)
        )
        revision = doc.revision
        if changed:
            by = "controller"
            new = doc.model_copy(
                update={"policy": policy, "state": state, "breakers": breakers, "updated_at": now, "updated_by": by}
            )
            if not await self.rollouts.write(new, doc.revision):
                return None
            revision += 1
        self._states[model] = (revision, state)
        for v in versions:
            self._breakers[(model, v)] = judged[v]
            self._tallies[(model, v)] = tallies[v]
        await self._record(doc, decision, moved, now)
        _set_gauges(model, policy, breakers)
        return Step(decision, moved, changed)

    def _judged(self, doc: RolloutDoc, version: str, tally: Tally, now: float) -> BreakerState:
        stored = doc.breakers.get(version, BreakerState())
        mine = self._breakers.get((doc.model, version))
        # my copy holds the window; the document wins when someone (a person, another controller) moved it
        base = (
            mine
            if mine is not None and (mine.status, mine.opened_at_s) == (stored.status, stored.opened_at_s)
            else stored
        )
        return judge(base, doc.breaker, tally, self._tallies.get((doc.model, version)), now)

    def _decide(
        self, doc: RolloutDoc, stats: dict[str, WindowStats], now: float
    ) -> tuple[Decision | None, RolloutState]:
        if doc.rollout is None or doc.policy.canary is None:
            return None, doc.state
        kept = self._states.get(doc.model)
        state = kept[1] if kept is not None and kept[0] == doc.revision else doc.state
        primary, canary = stats[doc.policy.primary], stats[doc.policy.canary]
        seen = Observation(
            primary=_version_stats(primary),
            canary=_version_stats(canary),
            agreement=canary.agreement,
            agreement_samples=canary.agreement_samples,
        )
        return decide(state, seen, doc.rollout, now)

    async def _record(
        self, doc: RolloutDoc, decision: Decision | None, moved: dict[str, BreakerState], now: float
    ) -> None:
        entries = [
            DecisionEntry(at=now, model=doc.model, action="breaker", version=v, reason=f"{v}: {s.reason}")
            for v, s in moved.items()
        ]
        if decision is not None and self._on_timeline(doc.model, decision):
            by = doc.state.override.by if doc.state.override is not None else "controller"
            entries.append(_entry(doc.model, decision, doc.policy.canary, by, now))
        for entry in entries:
            if entry.action != "hold":
                DECISIONS.labels(doc.model, entry.action).inc()
                log.info("rollout controller: %s %s: %s", doc.model, entry.action, entry.reason)
            await self.rollouts.add_decision(entry)

    def _on_timeline(self, model: str, decision: Decision) -> bool:
        """Every action but a hold; a hold when its reason, numbers aside, is new for the model."""
        if decision.action != "hold":
            self._last_hold.pop(model, None)
            return True
        key = re.sub(r"\d+(\.\d+)?", "#", decision.reason)
        if self._last_hold.get(model) == key:
            return False
        self._last_hold[model] = key
        return True

    def _forget(self, model: str) -> None:
        self._states.pop(model, None)
        self._last_hold.pop(model, None)
        for key in [k for k in self._breakers if k[0] == model]:
            self._breakers.pop(key, None)
            self._tallies.pop(key, None)


# -- a person's promote or rollback ---------------------------------------------------------------------------
def manual(
    doc: RolloutDoc, action: Literal["promote", "roll_back"], by: str, now: float
) -> tuple[RolloutDoc, DecisionEntry]:
    """The document after a person's promote or rollback of its canary, carried out at once through
    ``controller.override`` (also on a finished rollout: a rolled-back canary may still be promoted by hand), and
    the timeline's entry naming ``by``. The caller writes both (compare-and-set on ``doc.revision``).

    Raises:
        ValueError: the policy has no canary.
    """
    if doc.policy.canary is None:
        raise ValueError(f"model {doc.model!r} has no canary to {action.replace('_', ' ')}")
    config = doc.rollout or RolloutConfig()
    wish = override(replace(doc.state, phase="rolling"), action, by)
    empty = VersionStats(0, 0)
    decision, state = decide(wish, Observation(empty, empty), config, now)
    previous = doc.policy.canary_weight  # the weight in force, also when set by hand
    if action == "promote":
        reason = f"promoted by {by} at {_pct(previous)}"
    else:
        reason = f"rolled back by {by} from {_pct(previous)} to 0 %"
    decision = replace(decision, previous_weight=previous, reason=reason)
    policy = apply(doc.policy, decision)
    breakers = {v: s for v, s in doc.breakers.items() if v in versions_of(policy)}
    new = doc.model_copy(
        update={"policy": policy, "state": state, "breakers": breakers, "updated_at": now, "updated_by": by}
    )
    return new, _entry(doc.model, decision, doc.policy.canary, by, now)


# -- helpers --------------------------------------------------------------------------------------------------
def _entry(model: str, decision: Decision, canary: str | None, by: str, now: float) -> DecisionEntry:
    return DecisionEntry(
        at=now,
        model=model,
        action=ENTRY_ACTIONS[decision.action],
        weight=decision.weight,
        previous_weight=decision.previous_weight,
        version=canary,
        reason=decision.reason,
        by=by,
    )


def _version_stats(stats: WindowStats) -> VersionStats:
    return VersionStats(stats.requests, stats.failures, stats.p99_ms)


def _progress(state: RolloutState) -> tuple[object, ...]:
    """What of the controller's state is worth a write: not the baseline, which moves every tick."""
    return (state.phase, state.step, state.step_since_s, state.override)


def _stored(state: BreakerState) -> BreakerState:
    """A breaker as the document keeps it: its window stays with the controller that counts it."""
    return replace(state, buckets=())


def _pct(fraction: float) -> str:
    value = fraction * 100
    text = f"{value:.0f}" if abs(value) >= 100 else f"{value:.2f}".rstrip("0").rstrip(".")
    return f"{text} %"


def _set_gauges(model: str, policy: TrafficPolicy, breakers: dict[str, BreakerState]) -> None:
    CANARY_WEIGHT.labels(model).set(policy.canary_weight)
    for version, state in breakers.items():
        BREAKER_STATE.labels(model, version).set(BREAKER_VALUES[state.status])
