"""What one dispatcher knows about the workers of a model: liveness, idle tokens, outstanding work, latency.

The state is pure data with O(1) updates, driven by whoever owns the clock: the live dispatcher (wall time in
seconds, events from the broker and the store) or the simulator (simulated time in mean service times). Policies
(``fleet.dispatcher.policies``) read it to choose a worker; neither side does I/O here.

Vocabulary:

* **live**: the worker has heartbeated recently. Only live workers are ever chosen.
* **idle token**: a worker with a free slot announces itself idle to one dispatcher with a sequence number. The
  dispatcher keeps the tokens in arrival order (its *idle queue*). A token is used once; a token is stale when the
  worker has since sent a newer one, retracted it, or died, and stale tokens are dropped when met.
* **amnesia list**: the workers this dispatcher saw complete work within the last ``amnesia_window_s``; older
  entries are forgotten. Each carries a latency EWMA (assignment to completion, as this dispatcher observed it).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

W = TypeVar("W", bound=Hashable)

EWMA_ALPHA = 0.3  # weight of a new latency sample
FLOOR_ALPHA = 0.05  # how fast the floor EWMA creeps up when a worker gets slower
NEVER = float("-inf")


@dataclass(slots=True)
class WorkerView(Generic[W]):
    """One worker as one dispatcher sees it."""

    worker: W
    outstanding: int = 0  # assigned by this dispatcher and not yet completed
    ewma_s: float = 0.0  # latency EWMA; 0 until the first completion
    peak_s: float = 0.0  # peak-sensitive EWMA: jumps up to a slow sample at once, decays down slowly
    floor_s: float = 0.0  # floor-sensitive EWMA: drops to a fast sample at once; tracks the service time itself
    active_at: float = NEVER  # last completion seen
    chosen_at: float = NEVER  # last assignment made
    completed: int = 0
    assigned: int = 0


class Bag(Generic[W]):
    """A set with O(1) add, remove and uniform random sampling (list plus index, swap-remove)."""

    __slots__ = ("_index", "_items")

    def __init__(self) -> None:
        self._items: list[W] = []
        self._index: dict[W, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item: object) -> bool:
        return item in self._index

    def __iter__(self) -> Iterator[W]:
        return iter(self._items)

    def add(self, item: W) -> None:
        if item not in self._index:
            self._index[item] = len(self._items)
            self._items.append(item)

    def discard(self, item: W) -> None:
        i = self._index.pop(item, None)
        if i is None:
            return
        last = self._items.pop()
        if i < len(self._items):
            self._items[i] = last
            self._index[last] = i

    def at(self, i: int) -> W:
        return self._items[i]

    def choice(self, rng: random.Random) -> W:
        return self._items[int(rng.random() * len(self._items))]


@dataclass(slots=True)
class DispatcherState(Generic[W]):
    """The view of one dispatcher. Times are in the driver's unit (seconds live, service times in the simulator).

    Args:
        amnesia_window_s: how long a worker stays on the amnesia list after its last completion.
    """

    amnesia_window_s: float = 10.0
    live: Bag[W] = field(default_factory=Bag)
    views: dict[W, WorkerView[W]] = field(default_factory=dict)
    idle: deque[tuple[W, int]] = field(default_factory=deque)
    amnesia: Bag[W] = field(default_factory=Bag)
    _tokens: dict[W, int] = field(default_factory=dict)  # the one valid token per worker: its sequence number

    # -- liveness ---------------------------------------------------------------------------------------------
    def add_worker(self, worker: W) -> WorkerView[W]:
        self.live.add(worker)
        view = self.views.get(worker)
        if view is None:
            view = self.views[worker] = WorkerView(worker)
        return view

    def remove_worker(self, worker: W) -> None:
        """The worker stopped heartbeating: it gets no work and its token and amnesia entry go."""
        self.live.discard(worker)
        self.amnesia.discard(worker)
        self._tokens.pop(worker, None)

    def is_live(self, worker: W) -> bool:
        return worker in self.live

    # -- idle queue -------------------------------------------------------------------------------------------
    def add_token(self, worker: W, seq: int) -> bool:
        """Queue an idle token; a repeat of the worker's current token (a refresh) is not queued twice."""
        if worker not in self.live or self._tokens.get(worker) == seq:
            return False
        self._tokens[worker] = seq
        self.idle.append((worker, seq))
        return True

    def retract(self, worker: W, seq: int) -> None:
        """The worker took work elsewhere: its token ``seq`` is stale (dropped lazily from the queue)."""
        if self._tokens.get(worker) == seq:
            del self._tokens[worker]

    def pop_token(self) -> tuple[W, int] | None:
        """The first valid token (used once), dropping stale ones met on the way."""
        idle, tokens = self.idle, self._tokens
        while idle:
            worker, seq = idle.popleft()
            if tokens.get(worker) == seq:
                del tokens[worker]
                return worker, seq
        return None

    def peek_tokens(self, k: int) -> list[tuple[W, int]]:
        """The first ``k`` valid tokens, in queue order, without using them (stale ones at the front are dropped)."""
        idle, tokens = self.idle, self._tokens
        while idle and tokens.get(idle[0][0]) != idle[0][1]:
            idle.popleft()
        found: list[tuple[W, int]] = []
        for worker, seq in idle:
            if tokens.get(worker) == seq:
                found.append((worker, seq))
                if len(found) == k:
                    break
        return found

    def take_token(self, worker: W, seq: int) -> bool:
        """Use ``worker``'s token ``seq`` wherever it is in the queue (it is dropped from the queue lazily)."""
        if self._tokens.get(worker) != seq:
            return False
        del self._tokens[worker]
        return True

    @property
    def idle_length(self) -> int:
        """Valid tokens queued (what workers compare in JIQ-SQ(d))."""
        return len(self._tokens)

    def has_token(self, worker: W) -> bool:
        return worker in self._tokens

    def token_of(self, worker: W) -> int | None:
        """The sequence number of ``worker``'s valid token, if it has one."""
        return self._tokens.get(worker)

    # -- assignments and completions ---------------------------------------------------------------------------
    def on_assign(self, worker: W, now: float) -> None:
        view = self.views.get(worker) or self.add_worker(worker)
        view.outstanding += 1
        view.assigned += 1
        view.chosen_at = now

    def on_complete(self, worker: W, latency_s: float, now: float) -> None:
        """A job this dispatcher assigned to ``worker`` completed ``latency_s`` after the assignment."""
        view = self.views.get(worker)
        if view is None:
            return
        view.outstanding = max(0, view.outstanding - 1)
        view.completed += 1
        view.ewma_s = latency_s if view.completed == 1 else view.ewma_s + EWMA_ALPHA * (latency_s - view.ewma_s)
        view.peak_s = latency_s if latency_s > view.peak_s else view.peak_s + EWMA_ALPHA * (latency_s - view.peak_s)
        # The fastest recent completions are the ones that did not queue: their latency is the service time.
        view.floor_s = (
            latency_s
            if view.completed == 1 or latency_s < view.floor_s
            else view.floor_s + FLOOR_ALPHA * (latency_s - view.floor_s)
        )
        view.active_at = now
        if worker in self.live:
            self.amnesia.add(worker)

    def on_abandon(self, worker: W) -> None:
        """An assignment to ``worker`` was taken back (the worker died): it no longer counts as outstanding."""
        view = self.views.get(worker)
        if view is not None:
            view.outstanding = max(0, view.outstanding - 1)

    # -- amnesia list -----------------------------------------------------------------------------------------
    def sample_amnesia(self, d: int, now: float, rng: random.Random) -> list[WorkerView[W]]:
        """Up to ``d`` distinct live workers drawn from the amnesia list; entries past the window are forgotten."""
        amnesia, views = self.amnesia, self.views
        horizon = now - self.amnesia_window_s
        picked: list[WorkerView[W]] = []
        tries = 0
        while len(amnesia) and len(picked) < d and tries < 4 * d:
            tries += 1
            view = views[amnesia.choice(rng)]
            if view.active_at < horizon:
                amnesia.discard(view.worker)
            elif all(seen is not view for seen in picked):
                picked.append(view)
        return picked
