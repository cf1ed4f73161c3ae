"""Keys seen within a time window: the de-duplication memory of Kafka's publishing side (message ids this process
published) and of each partition on the consuming side (message ids of the records it admitted)."""

from __future__ import annotations

from collections import OrderedDict

PRUNE_EVERY = 64  # additions between two prunings


class RecentKeys:
    """``key -> time last seen``, oldest first, for keys seen within ``window`` (in the unit of the times given).

    ``seen`` checks the age itself, so pruning, every ``PRUNE_EVERY`` additions rather than on every call, only
    bounds the memory: to the keys of the last ``window``, and never more than ``max_keys``.
    """

    __slots__ = ("_adds", "_keys", "_max_keys", "_window")

    def __init__(self, window: float, max_keys: int) -> None:
        self._window, self._max_keys = window, max_keys
        self._keys: OrderedDict[str, float] = OrderedDict()
        self._adds = 0

    def __len__(self) -> int:
        return len(self._keys)

    def seen(self, key: str, now: float) -> bool:
        """Whether ``key`` was added within ``window`` of ``now`` (either side: record timestamps can go back)."""
        at = self._keys.get(key)
        return at is not None and abs(now - at) <= self._window

    def add(self, key: str, now: float) -> None:
        if key in self._keys:
            self._keys.move_to_end(key)  # seen again: it is the newest now
        self._keys[key] = now
        self._adds += 1
        if self._adds % PRUNE_EVERY == 0:
            self._prune(now)

    def _prune(self, now: float) -> None:
        keys = self._keys
        while keys:
            oldest = next(iter(keys.values()))
            if now - oldest <= self._window and len(keys) <= self._max_keys:
                return
            keys.popitem(last=False)
