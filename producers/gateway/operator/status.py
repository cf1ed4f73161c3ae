"""A model's scaling status as the operator surface shows it (``GET /v1/scaling`` and the dashboard's feed): the
autoscaler's last report, or an unreported one, with the operator's overrides on top.
"""

from __future__ import annotations

from fleet.schemas.scaling import ScalingOverrides, ScalingStatus
from fleet.settings import FleetSettings


def unreported(model: str, settings: FleetSettings) -> ScalingStatus:
    """The status of a served model the autoscaler has not reported on: no replicas, the default limits."""
    return ScalingStatus(
        model=model,
        current_replicas=0,
        desired_replicas=0,
        lag=None,
        arrival_rate=None,
        min_replicas=settings.autoscale_min_replicas,
        max_replicas=settings.autoscale_max_replicas,
        paused=False,
    )


def configured(status: ScalingStatus) -> ScalingOverrides:
    """The autoscaler's own limits (before overrides); the status's values when it did not say."""
    own = status.configured or ScalingOverrides()
    return ScalingOverrides(
        min_replicas=own.min_replicas if own.min_replicas is not None else status.min_replicas,
        max_replicas=own.max_replicas if own.max_replicas is not None else status.max_replicas,
        paused=own.paused if own.paused is not None else status.paused,
    )


def view(status: ScalingStatus, overrides: ScalingOverrides, decisions: int) -> ScalingStatus:
    """``status`` with the operator's ``overrides`` on top of the autoscaler's own limits, its newest decisions."""
    base = status.model_copy(update=configured(status).limits())
    shown = base.with_overrides(overrides)
    shown.decisions = shown.decisions[:decisions]
    return shown


def shown_status(
    model: str, stored: ScalingStatus | None, overrides: ScalingOverrides, settings: FleetSettings, decisions: int
) -> ScalingStatus:
    """A model's status as ``GET /v1/scaling`` shows it: the stored one (or an unreported one) with the overrides."""
    return view(stored or unreported(model, settings), overrides, decisions)
