"""The worker's half of JIQ, shared by the live worker (``fleet.consumers.idle``) and the simulator (``dispatcher``).

A newly idle worker announces itself to one dispatcher: a random one (JIQ-Random), or the one with the shortest
idle queue among ``d`` sampled (JIQ-SQ(d)). Dispatchers advertise which rule their policy wants in their
heartbeats (``fleet.schemas.wire.DispatcherBeat.announce``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

Announce = Literal["none", "random", "sq"]


def announce_to(idle_lengths: Sequence[int], rule: Announce, d: int, rng: random.Random) -> int:
    """Index of the dispatcher a newly idle worker announces itself to, given each one's idle-queue length."""
    n = len(idle_lengths)
    if rule != "sq" or n <= 1:
        return int(rng.random() * n)
    return min(rng.sample(range(n), min(d, n)), key=idle_lengths.__getitem__)  # d distinct dispatchers
