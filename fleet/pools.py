"""Pools: named sets of models served by the same multi-model workers (``FLEET_POOLS``, ``fleet worker --pool``).

A pool ``nlp = sentiment + ner@2 + embed`` is one kind of worker that serves all three (loading each on demand
within its memory budget); the autoscaler scales it as one target, on the sum of its models' demand
(``fleet.autoscaler.pools``), and its backends start pool workers with ``--models sentiment,ner@2,embed``. A model
is in one pool at most, so its demand is counted once; a served model in no pool is a target of its own.

Members are model repository (or built-in) references: ``name`` (any version, loaded on demand) or
``name@version`` (that version only). Pure and a leaf: the settings, the CLI and the autoscaler import it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from fleet.constants import MODEL_NAME_RE

_VERSION_RE = re.compile(r"^[a-z0-9][a-z0-9_]{0,31}$")  # fleet.schemas.manifest.VERSION_RE (a leaf needs its own)
MAX_POOL_MODELS = 64


def ref_name(ref: str) -> str:
    """The model name of a member reference: ``ner@2`` -> ``ner``."""
    return ref.partition("@")[0]


def check_ref(pool: str, ref: str) -> None:
    name, at, version = ref.partition("@")
    if not MODEL_NAME_RE.match(name) or (at and not _VERSION_RE.match(version)):
        raise ValueError(
            f"pools: {ref!r} in pool {pool!r} is not a model reference; write NAME or NAME@VERSION "
            "(lower-case letters, digits, '-' and '_')"
        )


def check_pools(pools: Mapping[str, Sequence[str]]) -> None:
    """Refuse a bad pool name or reference, an empty pool, a model twice, a model in two pools, and a pool named
    like a model it or another pool serves (the autoscaler and the dashboard name targets by name).

    Raises:
        ValueError: the first problem, naming the pool and the reference.
    """
    owner: dict[str, str] = {}
    for pool, refs in pools.items():
        if not MODEL_NAME_RE.match(pool):
            raise ValueError(f"pools: pool name {pool!r} must be lower-case letters, digits, '-' and '_'")
        if not refs:
            raise ValueError(f"pools: pool {pool!r} has no models")
        if len(refs) > MAX_POOL_MODELS:
            raise ValueError(f"pools: pool {pool!r} has {len(refs)} models; at most {MAX_POOL_MODELS}")
        for ref in refs:
            check_ref(pool, ref)
            name = ref_name(ref)
            if name in owner:
                where = "twice in it" if owner[name] == pool else f"also in pool {owner[name]!r}"
                raise ValueError(f"pools: model {name!r} of pool {pool!r} is {where}; a model is in one pool at most")
            owner[name] = pool
    clash = sorted(set(pools) & set(owner))
    if clash:
        raise ValueError(f"pools: pool {clash[0]!r} is named like a model of pool {owner[clash[0]]!r}")


def members(pools: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """Pool name -> the model names it serves (versions dropped: demand and subjects are per model name)."""
    return {pool: tuple(dict.fromkeys(ref_name(ref) for ref in refs)) for pool, refs in pools.items()}


def pool_of(pools: Mapping[str, Sequence[str]], model: str) -> str | None:
    """The pool serving ``model`` (a name), if any."""
    return next((pool for pool, names in members(pools).items() if model in names), None)


def scaling_targets(models: Sequence[str], pools: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """What the autoscaler scales, each with the model names its workers serve: every pool, then every model of
    ``models`` (names) in no pool, alone."""
    targets = members(pools)
    pooled = {name for names in targets.values() for name in names}
    for model in models:
        if model not in pooled:
            targets.setdefault(model, (model,))
    return targets


def models_flag(refs: Sequence[str]) -> str:
    """The ``fleet worker --models`` value of a pool: ``sentiment,ner@2,embed``."""
    return ",".join(refs)
