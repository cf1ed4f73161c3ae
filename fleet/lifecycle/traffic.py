"""A model's traffic policy and the pure routing decision: which version answers a request, and which one shadows it.

``route(policy, request_key, draw) -> Routing`` does no I/O and draws no random numbers; the caller passes ``draw``,
a uniform number in [0, 1) (``random.random()``), and the request's sticky key (``request_key``, built from the
policy's ``sticky`` source; ``None`` when the policy has none or the request lacks it). The steps:

1. **The point.** With a sticky key, the point is the key's bucket: the first 8 bytes of
   ``sha256(model NUL key)`` as a fraction of 2**64. Not Python's ``hash()``, which is salted per process, so every
   gateway puts a key in the same bucket. Without a key, the point is ``draw``.
2. **The split.** ``point < canary_weight`` goes to the canary, anything else to the primary. A key's bucket never
   changes, so its version is the same on every request while the weight stays; and as the weight grows the canary
   range ``[0, weight)`` only widens, so a key in the 5 % canary is still in it at 10 % (and a key leaves the canary
   only when the weight shrinks, a rollback).
3. **The shadow.** With a shadow version, a request is also mirrored to it when ``shadow_draw`` falls in the top
   ``shadow_share`` of [0, 1): ``shadow_draw >= 1 - shadow_share``. ``shadow_draw`` defaults to ``draw``, so with
   ``canary_weight + shadow_share <= 1`` and no sticky key, the mirrored requests are ones the primary answers
   (the comparison is primary against shadow); pass an independent uniform to mirror independently of the split.
   The shadow's output is stored beside the answer and compared, never returned.

``Routing.reason`` says why in words, e.g. ``"draw 0.03 < canary weight 0.05: canary 2; mirrored to shadow 3
(share 0.1)"``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

StickySource = Literal["none", "tenant", "field", "header"]
Arm = Literal["primary", "canary"]
_BUCKETS = float(2**64)


class StickyKey(BaseModel):
    """Where a request's sticky key comes from: ``none`` (every request draws), ``tenant`` (A/B by tenant),
    ``field`` (a top-level field of the job's input, ``name``) or ``header`` (an HTTP header, ``name``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: StickySource = "none"
    name: str | None = Field(None, min_length=1, max_length=256, description="the field or header name")

    @model_validator(mode="after")
    def _name_where_needed(self) -> StickyKey:
        if self.source in ("field", "header") and self.name is None:
            raise ValueError(f"sticky source {self.source!r} needs a 'name' (which {self.source} holds the key)")
        if self.source in ("none", "tenant") and self.name is not None:
            raise ValueError(f"sticky source {self.source!r} takes no 'name' (got {self.name!r})")
        return self


class TrafficPolicy(BaseModel):
    """How one model's requests are split between its versions. Immutable; ``with_canary_weight`` re-validates.

    Rejected when parsed: a canary or shadow that is the primary, a version that is both canary and shadow, a
    weight or share outside 0..1, and a weight or share above 0 without its version.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    primary: str = Field(min_length=1, description="the version that answers unless the split says canary")
    canary: str | None = Field(None, min_length=1, description="the candidate version that answers a share")
    canary_weight: float = Field(0.0, ge=0.0, le=1.0, description="share of requests the canary answers")
    shadow: str | None = Field(None, min_length=1, description="a version that also computes a share, never answers")
    shadow_share: float = Field(0.0, ge=0.0, le=1.0, description="share of requests mirrored to the shadow")
    sticky: StickyKey = Field(default_factory=StickyKey, description="where the sticky key comes from")

    @model_validator(mode="after")
    def _consistent(self) -> TrafficPolicy:
        problems = []
        if self.canary is not None and self.canary == self.primary:
            problems.append(f"canary {self.canary!r} is the primary")
        if self.shadow is not None and self.shadow == self.primary:
            problems.append(f"shadow {self.shadow!r} is the primary")
        if self.canary is not None and self.canary == self.shadow:
            problems.append(f"version {self.canary!r} is both canary and shadow; give it one role")
        if self.canary is None and self.canary_weight > 0:
            problems.append(f"canary_weight {self.canary_weight} without a canary version")
        if self.shadow is None and self.shadow_share > 0:
            problems.append(f"shadow_share {self.shadow_share} without a shadow version")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def with_canary_weight(self, weight: float) -> TrafficPolicy:
        """A copy with the canary's weight changed (validated as a new policy)."""
        return TrafficPolicy.model_validate({**self.model_dump(), "canary_weight": weight})


@dataclass(frozen=True, slots=True)
class Routing:
    """Where one request goes."""

    version: str  # the version that answers
    arm: Arm
    shadow_version: str | None  # also computes the request; its output is compared and never returned
    reason: str


def bucket(model: str, key: str) -> float:
    """The key's stable point in [0, 1) for ``model``: the same in every process and on every machine."""
    digest = hashlib.sha256(f"{model}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / _BUCKETS


def request_key(
    sticky: StickyKey, tenant: str | None, fields: Mapping[str, Any], headers: Mapping[str, str]
) -> str | None:
    """The sticky key of a request: its tenant, one of its input's top-level fields (as text), or a header.

    ``headers`` should be case-insensitive (Starlette's are); ``None`` when the source is ``none`` or the request
    does not carry the key (such a request draws like any other).
    """
    if sticky.source == "tenant":
        return tenant
    if sticky.source == "field" and sticky.name is not None:
        value = fields.get(sticky.name)
        return None if value is None or isinstance(value, dict | list) else str(value)
    if sticky.source == "header" and sticky.name is not None:
        return headers.get(sticky.name)
    return None


def route(
    policy: TrafficPolicy, request_key: str | None, draw: float, *, model: str = "", shadow_draw: float | None = None
) -> Routing:
    """Pick the version that answers a request, and the shadow that also computes it (see the module docstring).

    Args:
        policy: the model's validated traffic policy.
        request_key: the request's sticky key (``request_key()``), or ``None`` to split by ``draw``.
        draw: a uniform number in [0, 1) from the caller's random source.
        model: the model's name, mixed into the sticky hash so one key lands in unrelated buckets per model.
        shadow_draw: a uniform in [0, 1) for the mirror decision; default ``draw`` (see the module docstring).

    Raises:
        ValueError: ``draw`` or ``shadow_draw`` outside [0, 1).
    """
    _check_uniform("draw", draw)
    shadow_point = draw if shadow_draw is None else shadow_draw
    _check_uniform("shadow_draw", shadow_point)
    arm, why = _split(policy, request_key, draw, model)
    version = policy.canary if arm == "canary" and policy.canary is not None else policy.primary
    why = f"{why}: {arm} {version}"
    shadow = _shadow(policy, shadow_point)
    if shadow is not None:
        why = f"{why}; mirrored to shadow {shadow} (share {_num(policy.shadow_share)})"
    return Routing(version=version, arm=arm, shadow_version=shadow, reason=why)


def _split(policy: TrafficPolicy, key: str | None, draw: float, model: str) -> tuple[Arm, str]:
    weight = policy.canary_weight
    if policy.canary is None or weight <= 0:
        return "primary", "no canary"
    if key is not None:
        point, what = bucket(model, key), "sticky key bucket"
    else:
        point, what = draw, "draw"
    if point < weight:
        return "canary", f"{what} {_num(point)} < canary weight {_num(weight)}"
    return "primary", f"{what} {_num(point)} >= canary weight {_num(weight)}"


def _shadow(policy: TrafficPolicy, point: float) -> str | None:
    if policy.shadow is None or policy.shadow_share <= 0:
        return None
    return policy.shadow if point >= 1.0 - policy.shadow_share else None


def _check_uniform(name: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a uniform number in [0, 1), got {value!r}")


def _num(value: float) -> str:
    return f"{value:.4f}".rstrip("0").rstrip(".") or "0"
