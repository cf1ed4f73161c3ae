"""Which loaded models to evict for a load, least recently used first. A pure function, table-tested."""

from __future__ import annotations

from collections.abc import Container, Hashable, Mapping, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def evictions(
    order: Sequence[K], sizes: Mapping[K, int], busy: Container[K], needed: int, budget: int | None
) -> list[K] | None:
    """The entries to evict so that a model of ``needed`` bytes fits beside the rest within ``budget``.

    Args:
        order: the loaded entries, least recently used first.
        sizes: each loaded entry's bytes.
        busy: entries computing now, which are never evicted.
        needed: the bytes of the model about to be loaded.
        budget: the bytes allowed in all (None: no budget, nothing is evicted).

    Returns:
        The idle entries to evict, least recently used first and no more than needed ([] when it fits as is), or
        None when evicting every idle entry would not be enough (the busy ones must finish first).
    """
    if budget is None:
        return []
    used = sum(sizes[key] for key in order)
    chosen: list[K] = []
    for key in order:
        if used + needed <= budget:
            break
        if key in busy:
            continue
        chosen.append(key)
        used -= sizes[key]
    return chosen if used + needed <= budget else None
