"""``ScalingConfig``: how one model's workers are scaled, validated when it is parsed.

Single-field limits (``max_replicas >= 1``, ``stale_after_s > 0``...) are pydantic constraints. Settings that
contradict each other are rejected together, each with a message naming both settings:

- ``min_replicas`` above ``max_replicas``;
- ``mode='keda'`` without ``lag_per_replica`` (the KEDA formula ``ceil(lag / lag_per_replica)`` needs it);
- ``lag_per_replica`` with ``mode='rate'`` (it would be silently ignored; the user almost surely meant ``keda``);
- ``predictive_horizon_s`` or ``default_throughput_per_replica`` with ``mode='keda'`` (both feed the rate
  formula only);
- ``activation_lag > 0`` with ``min_replicas >= 1`` (activation decides 0 <-> 1, so it only matters when the
  model may scale to zero).

``target_drain_s``, ``trend_window_s`` and ``queue_age_scale_in_ratio`` have non-``None`` defaults and are simply
unused where they do not apply (``keda`` mode, no predictive term, no age target), so a caller that always passes
every field is not rejected for them.

A pydantic ``ValidationError`` is a ``ValueError``; its text carries the messages above.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ScalingMode = Literal["rate", "keda"]


class ScalingConfig(BaseModel):
    """Per-model scaling settings. Immutable; build a changed copy with :meth:`with_changes` (it re-validates)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: ScalingMode = Field(
        "rate",
        description="'rate': ceil((arrival_rate + lag / target_drain_s) / throughput_per_replica); "
        "'keda': ceil(lag / lag_per_replica), like KEDA's Kafka scaler",
    )
    min_replicas: int = Field(0, ge=0, description="fewest replicas; 0 allows scale to zero")
    max_replicas: int = Field(4, ge=1, description="most replicas (Kafka partitions cap it further)")
    target_drain_s: float = Field(
        30.0, gt=0, description="rate mode: size the fleet to drain the current backlog within this many seconds"
    )
    lag_per_replica: int | None = Field(
        None, ge=1, description="keda mode only (required there): backlog one replica is expected to handle"
    )
    activation_lag: int = Field(
        0,
        ge=0,
        description="scale from zero only when the lag exceeds this; back to zero only with no lag and no arrivals",
    )
    scale_up_step: int = Field(
        4, ge=1, description="at most this many replicas are added within any scale_up_interval_s"
    )
    scale_up_interval_s: float = Field(
        5.0, ge=0, description="sliding window of the scale-up rate limit (0: scale_up_step per decision)"
    )
    scale_down_stabilization_s: float = Field(
        60.0,
        ge=0,
        description="scale down only to the highest recommendation seen within this many seconds (no flapping)",
    )
    stale_after_s: float = Field(
        30.0, gt=0, description="signals older than this are ignored and the replica count is kept"
    )
    predictive_horizon_s: float | None = Field(
        None,
        gt=0,
        description="rate mode: add capacity for the arrival-rate trend extrapolated this far ahead "
        "(set it to a worker's start-up time); None turns the predictive term off",
    )
    trend_window_s: float = Field(
        30.0, gt=0, description="predictive term: fit the arrival-rate trend over the samples of this many seconds"
    )
    default_throughput_per_replica: float | None = Field(
        None, gt=0, description="rate mode: jobs/s per replica assumed until heartbeats report a throughput"
    )
    max_queue_age_s: float | None = Field(
        None,
        gt=0,
        le=86_400,
        description="the longest a request may wait (the age of the oldest one not finished): older scales out "
        "in proportion (ceil(replicas * age / target)), whatever the lag says; None: lag and rates only",
    )
    queue_age_scale_in_ratio: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="with max_queue_age_s: the age rule lets the fleet shrink only once the oldest request is "
        "younger than this share of the target; between the two it holds the current replicas (hysteresis)",
    )
    paused: bool = Field(False, description="keep the current replica count whatever the signals say")

    @model_validator(mode="after")
    def _no_conflicts(self) -> ScalingConfig:
        problems = conflicts(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def with_changes(self, **changes: Any) -> ScalingConfig:
        """A copy with ``changes`` applied and validated again (``model_copy`` would skip validation).

        Raises:
            ValueError: a change breaks a constraint or conflicts with another setting.
        """
        return type(self).model_validate({**self.model_dump(exclude_unset=True), **changes})


def conflicts(config: ScalingConfig) -> list[str]:
    """Every pair of settings in ``config`` that contradict each other, as messages naming both."""
    problems: list[str] = []
    if config.min_replicas > config.max_replicas:
        problems.append(f"min_replicas ({config.min_replicas}) is above max_replicas ({config.max_replicas})")
    problems.extend(_mode_conflicts(config))
    if config.activation_lag > 0 and config.min_replicas >= 1:
        problems.append(
            f"activation_lag ({config.activation_lag}) only applies when scaling to zero, "
            f"but min_replicas is {config.min_replicas}; set min_replicas to 0 or activation_lag to 0"
        )
    return problems


def _mode_conflicts(config: ScalingConfig) -> list[str]:
    if config.mode == "keda":
        problems = (
            []
            if config.lag_per_replica is not None
            else ["mode 'keda' requires lag_per_replica (the backlog one replica handles)"]
        )
        for name in ("predictive_horizon_s", "default_throughput_per_replica"):
            if getattr(config, name) is not None:
                problems.append(f"{name} only applies with mode 'rate', but mode is 'keda'")
        return problems
    if config.lag_per_replica is not None:
        return [
            f"lag_per_replica ({config.lag_per_replica}) only applies with mode 'keda', but mode is 'rate'; "
            "set mode='keda' or drop lag_per_replica"
        ]
    return []
