"""Autoscaler state as stored in Redis and served by ``GET/PUT /v1/scaling``.

``DecisionRecord`` is one decision with its inputs and reason; ``ScalingStatus`` is a model's latest state with its
recent decisions; ``ScalingOverrides`` are what an operator set through the API on top of the autoscaler's own
configuration; ``ScalingUpdate`` is the ``PUT`` body.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field

LIMIT_FIELDS = ("min_replicas", "max_replicas", "paused")  # the overrides that change the policy's configuration


class Pin(BaseModel):
    """A scale-to-N override: the autoscaler holds ``replicas`` until ``until``."""

    replicas: int = Field(ge=0)
    until: float = Field(description="unix seconds; after this the normal policy applies again")


class ScalingOverrides(BaseModel):
    """Operator overrides of one model's scaling; ``None`` leaves the autoscaler's configured value.

    ``pinned_replicas`` with ``pinned_until`` is a scale-to-N (``POST /v1/scaling/{model}/scale``): the autoscaler
    holds that many replicas until that unix time, then its policy applies again.
    """

    min_replicas: int | None = Field(None, ge=0)
    max_replicas: int | None = Field(None, ge=1)
    paused: bool | None = None
    pinned_replicas: int | None = Field(None, ge=0)
    pinned_until: float | None = None

    def is_empty(self) -> bool:
        return all(getattr(self, name) is None for name in type(self).model_fields)

    def limits(self) -> dict[str, int | bool]:
        """The min, max and pause overrides that are set (what changes the policy's configuration)."""
        return {name: value for name in LIMIT_FIELDS if (value := getattr(self, name)) is not None}

    def pin(self, now: float) -> Pin | None:
        """The scale-to-N override in force at unix time ``now``; None when there is none or it expired."""
        if self.pinned_replicas is None or self.pinned_until is None or self.pinned_until <= now:
            return None
        return Pin(replicas=self.pinned_replicas, until=self.pinned_until)


class DecisionRecord(BaseModel):
    """One decision of the autoscaler, with the signals it was made from."""

    at: float = Field(description="unix seconds")
    model: str
    current_replicas: int = Field(description="replicas the backend ran before the decision")
    desired_replicas: int = Field(description="the policy's raw recommendation, before min/max and smoothing")
    replicas: int = Field(description="what the autoscaler scaled to")
    lag: int | None = Field(description="requests not yet finished (waiting + in flight); null when unknown")
    arrival_rate: float | None = Field(description="requests per second arriving; null when unknown")
    throughput_per_replica: float | None = Field(description="requests per second one busy worker finishes")
    reason: str = Field(description="why, in words")
    changed: bool = Field(False, description="whether the replica count changed")
    owner: str | None = Field(None, description="id of the autoscaler that decided")


class PoolMember(BaseModel):
    """One model of a pool, as the autoscaler read it at its last tick: its part of the pool's demand."""

    model: str
    lag: int | None = Field(description="requests of this model not yet finished; null when unknown")
    arrival_rate: float | None = Field(description="requests per second of this model arriving; null when unknown")
    throughput_per_replica: float | None = Field(None, description="jobs/s one worker finishes of this model")


class ScalingStatus(BaseModel):
    """A model's latest scaling state and its recent decisions, newest first."""

    model: str
    current_replicas: int = Field(description="replicas running now, as the backend reports them")
    desired_replicas: int = Field(
        description="replicas the signals ask for, within min/max; the fleet heads there as fast as the "
        "scale-up rate limit and the scale-down stabilization window allow"
    )
    lag: int | None = Field(description="requests not yet finished (waiting + in flight); null when unknown")
    arrival_rate: float | None = Field(description="requests per second arriving; null when unknown")
    queue_age_s: float | None = Field(
        None, description="seconds the oldest unfinished request has waited; null when none waits (or unknown)"
    )
    min_replicas: int
    max_replicas: int
    paused: bool
    backend: str | None = Field(None, description="process, inprocess, kubernetes or dry-run; null: no autoscaler")
    updated_at: float | None = Field(None, description="unix seconds of the last update; null: never")
    throughput_per_replica: float | None = None
    completion_rate: float | None = Field(None, description="requests per second finished by all workers")
    live_workers: int | None = Field(None, description="workers whose heartbeats are current")
    reason: str | None = Field(None, description="the reason of the last decision")
    wanted_replicas: int | None = Field(
        None, description="the policy's recommendation at the last tick, before min/max and smoothing"
    )
    pinned: Pin | None = Field(None, description="an active scale-to-N override (POST /v1/scaling/{model}/scale)")
    configured: ScalingOverrides | None = Field(
        None, description="the autoscaler's own min, max and pause, before the operator's overrides"
    )
    pool: list[PoolMember] | None = Field(
        None,
        description="a pool (FLEET_POOLS): its models, whose summed demand its workers are scaled on; "
        "``model`` is then the pool's name. null: a single model",
    )
    decisions: list[DecisionRecord] = Field(default_factory=list, description="recent decisions, newest first")

    def with_overrides(self, overrides: ScalingOverrides) -> ScalingStatus:
        """This status with ``overrides`` in place of the configured min, max and pause."""
        changes: dict[str, object] = dict(overrides.limits())
        changes["pinned"] = overrides.pin(time.time())
        return self.model_copy(update=changes)


class ScalingUpdate(BaseModel):
    """``PUT /v1/scaling/{model}``: fields left out keep their value; an explicit ``null`` removes the override,
    so the autoscaler's configured value applies again."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int | None = Field(None, ge=0, description="fewest replicas (0 allows scale to zero)")
    max_replicas: int | None = Field(None, ge=1, description="most replicas")
    paused: bool | None = Field(None, description="true: keep the replica count whatever the signals say")

    def apply(self, overrides: ScalingOverrides) -> ScalingOverrides:
        """The overrides after this update (not yet checked against the configured values)."""
        changes = {name: getattr(self, name) for name in self.model_fields_set}
        return overrides.model_copy(update=changes)


def check_limits(min_replicas: int, max_replicas: int) -> None:
    """Raises ValueError naming both settings when ``min_replicas`` is above ``max_replicas``."""
    if min_replicas > max_replicas:
        raise ValueError(
            f"min_replicas ({min_replicas}) is above max_replicas ({max_replicas}); "
            "lower min_replicas or raise max_replicas"
        )
