"""The pure traffic policy, by tables: validation, the weighted split, sticky keys (stable and monotonic in the
weight), the shadow mirror, and the sticky key's sources."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from fleet.lifecycle.traffic import StickyKey, TrafficPolicy, bucket, request_key, route


def policy(**fields: Any) -> TrafficPolicy:
    return TrafficPolicy.model_validate({"primary": "1", **fields})


# -- validation -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"canary": "1"}, "canary '1' is the primary"),
        ({"shadow": "1"}, "shadow '1' is the primary"),
        ({"canary": "2", "shadow": "2"}, "version '2' is both canary and shadow"),
        ({"canary_weight": 0.1}, "canary_weight 0.1 without a canary version"),
        ({"shadow_share": 0.5}, "shadow_share 0.5 without a shadow version"),
        ({"canary": "2", "canary_weight": 1.5}, "less than or equal to 1"),
        ({"canary": "2", "canary_weight": -0.1}, "greater than or equal to 0"),
        ({"shadow": "3", "shadow_share": 2}, "less than or equal to 1"),
        ({"primary": ""}, "at least 1 character"),
        ({"sticky": {"source": "header"}}, "sticky source 'header' needs a 'name'"),
        ({"sticky": {"source": "field"}}, "sticky source 'field' needs a 'name'"),
        ({"sticky": {"source": "tenant", "name": "x"}}, "sticky source 'tenant' takes no 'name'"),
        ({"sticky": {"source": "cookie", "name": "x"}}, "'none', 'tenant', 'field' or 'header'"),
        ({"weights": {"2": 0.1}}, "Extra inputs are not permitted"),
    ],
    ids=[
        "canary-is-primary",
        "shadow-is-primary",
        "canary-and-shadow",
        "weight-without-canary",
        "share-without-shadow",
        "weight-above-one",
        "weight-negative",
        "share-above-one",
        "empty-primary",
        "header-without-name",
        "field-without-name",
        "tenant-with-name",
        "unknown-source",
        "unknown-field",
    ],
)
def test_invalid_policies_are_refused_with_a_reason(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        policy(**fields)


def test_a_full_policy_parses_and_reweights() -> None:
    p = policy(canary="2", canary_weight=0.05, shadow="3", shadow_share=0.2, sticky={"source": "header", "name": "X"})
    assert p.with_canary_weight(0.1).canary_weight == 0.1
    with pytest.raises(ValidationError):
        p.with_canary_weight(1.01)


# -- the split ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "draw", "version", "reason"),
    [
        ({}, 0.0, "1", "no canary: primary 1"),
        ({"canary": "2"}, 0.0, "1", "no canary: primary 1"),  # weight 0
        ({"canary": "2", "canary_weight": 0.1}, 0.05, "2", "draw 0.05 < canary weight 0.1: canary 2"),
        ({"canary": "2", "canary_weight": 0.1}, 0.1, "1", "draw 0.1 >= canary weight 0.1: primary 1"),
        ({"canary": "2", "canary_weight": 1.0}, 0.9999, "2", "draw 0.9999 < canary weight 1: canary 2"),
    ],
    ids=["primary-only", "canary-at-zero", "below-weight", "at-weight-is-primary", "weight-one-all-canary"],
)
def test_split_by_draw(fields: dict[str, Any], draw: float, version: str, reason: str) -> None:
    routing = route(policy(**fields), None, draw)
    assert (routing.version, routing.reason, routing.shadow_version) == (version, reason, None)


@pytest.mark.parametrize("draw", [-0.01, 1.0, 1.5, float("nan")])
def test_a_draw_outside_the_unit_interval_is_refused(draw: float) -> None:
    with pytest.raises(ValueError, match="draw must be a uniform number"):
        route(policy(canary="2", canary_weight=0.5), None, draw)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_ten_percent_canary_gets_ten_percent_of_5000_draws(seed: int) -> None:
    rng = random.Random(seed)
    p = policy(canary="2", canary_weight=0.1)
    canary = sum(route(p, None, rng.random()).version == "2" for _ in range(5_000))
    assert 0.08 * 5_000 <= canary <= 0.12 * 5_000, canary


def test_a_ten_percent_canary_gets_ten_percent_of_5000_sticky_keys() -> None:
    p = policy(canary="2", canary_weight=0.1, sticky={"source": "tenant"})
    canary = sum(route(p, f"tenant-{i}", 0.5, model="embed").version == "2" for i in range(5_000))
    assert 0.08 * 5_000 <= canary <= 0.12 * 5_000, canary


# -- sticky keys ----------------------------------------------------------------------------------------------
def test_a_sticky_key_ignores_the_draw_and_never_changes_version() -> None:
    p = policy(canary="2", canary_weight=0.3, sticky={"source": "tenant"})
    rng = random.Random(7)
    for i in range(200):
        key = f"user-{i}"
        versions = {route(p, key, rng.random(), model="embed").version for _ in range(20)}
        assert len(versions) == 1, (key, versions)
        assert versions == {"2" if bucket("embed", key) < 0.3 else "1"}


def test_the_bucket_is_a_stable_hash_not_pythons_salted_one() -> None:
    # sha256("embed\0alice")[:8] as a fraction of 2**64: the same in every process, on every machine
    assert bucket("embed", "alice") == pytest.approx(0.999455, abs=1e-6)
    assert bucket("embed", "alice") != bucket("classify", "alice")  # a key lands independently per model


@given(
    key=st.text(min_size=1, max_size=40),
    low=st.floats(0.0, 1.0),
    high=st.floats(0.0, 1.0),
)
def test_a_keys_canary_assignment_survives_a_growing_weight(key: str, low: float, high: float) -> None:
    low, high = min(low, high), max(low, high)
    small = policy(canary="2", canary_weight=low, sticky={"source": "tenant"})
    large = small.with_canary_weight(high)
    if route(small, key, 0.5, model="m").version == "2":
        assert route(large, key, 0.5, model="m").version == "2"


def test_growing_weights_only_add_keys_to_the_canary() -> None:
    keys = [f"k{i}" for i in range(2_000)]
    previous: set[str] = set()
    for weight in (0.05, 0.1, 0.25, 0.5, 1.0):
        p = policy(canary="2", canary_weight=weight, sticky={"source": "tenant"})
        canary = {k for k in keys if route(p, k, 0.0, model="m").arm == "canary"}
        assert previous <= canary
        assert abs(len(canary) - weight * len(keys)) <= 0.03 * len(keys), (weight, len(canary))
        previous = canary
    assert previous == set(keys)


# -- the shadow -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "draw", "shadow_draw", "version", "shadow"),
    [
        ({"shadow": "3", "shadow_share": 0.2}, 0.85, None, "1", "3"),
        ({"shadow": "3", "shadow_share": 0.2}, 0.75, None, "1", None),
        ({"shadow": "3", "shadow_share": 1.0}, 0.0, None, "1", "3"),
        ({"shadow": "3", "shadow_share": 0.0}, 0.99, None, "1", None),
        ({"canary": "2", "canary_weight": 0.1, "shadow": "3", "shadow_share": 0.2}, 0.05, None, "2", None),
        ({"canary": "2", "canary_weight": 0.1, "shadow": "3", "shadow_share": 0.2}, 0.05, 0.9, "2", "3"),
        ({"canary": "2", "canary_weight": 0.1, "shadow": "3", "shadow_share": 0.2}, 0.95, 0.1, "1", None),
    ],
    ids=[
        "top-share-mirrored",
        "below-share-not",
        "share-one-mirrors-all",
        "share-zero-mirrors-none",
        "canary-draw-not-mirrored-by-default",
        "independent-shadow-draw",
        "independent-shadow-draw-not",
    ],
)
def test_shadow_mirror(
    fields: dict[str, Any], draw: float, shadow_draw: float | None, version: str, shadow: str | None
) -> None:
    routing = route(policy(**fields), None, draw, shadow_draw=shadow_draw)
    assert (routing.version, routing.shadow_version) == (version, shadow)
    assert ("mirrored to shadow 3" in routing.reason) == (shadow is not None)


def test_a_twenty_percent_shadow_mirrors_twenty_percent_and_never_answers() -> None:
    rng = random.Random(11)
    p = policy(canary="2", canary_weight=0.1, shadow="3", shadow_share=0.2)
    routings = [route(p, None, rng.random(), shadow_draw=rng.random()) for _ in range(5_000)]
    assert {r.version for r in routings} == {"1", "2"}
    mirrored = sum(r.shadow_version == "3" for r in routings)
    assert 0.18 * 5_000 <= mirrored <= 0.22 * 5_000, mirrored


# -- the sticky key's sources ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("sticky", "expected"),
    [
        ({}, None),
        ({"source": "tenant"}, "acme"),
        ({"source": "field", "name": "user"}, "u-7"),
        ({"source": "field", "name": "count"}, "3"),
        ({"source": "field", "name": "texts"}, None),  # a list is no key
        ({"source": "field", "name": "missing"}, None),
        ({"source": "header", "name": "X-User"}, "h-1"),
        ({"source": "header", "name": "X-Other"}, None),
    ],
    ids=["none", "tenant", "field", "number-field", "list-field", "missing-field", "header", "missing-header"],
)
def test_request_key(sticky: dict[str, Any], expected: str | None) -> None:
    fields = {"user": "u-7", "count": 3, "texts": ["a"]}
    key = request_key(StickyKey.model_validate(sticky), "acme", fields, {"X-User": "h-1"})
    assert key == expected
