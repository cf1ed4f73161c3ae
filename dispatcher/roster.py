"""Which workers of a model are alive, from their heartbeats; pure bookkeeping, the dispatcher feeds it.

A worker counts as live while it heartbeats in ``dispatch`` routing with state ``ready``. It is *gone* when it
says ``stopped`` or falls silent for ``stale_after_s``: its unfinished assignments are then given to others. A
``draining`` worker gets no new work but keeps what it has: it is finishing it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleet.schemas.wire import Heartbeat


@dataclass(slots=True)
class Roster:
    stale_after_s: float
    seen: dict[str, float] = field(default_factory=dict)  # worker id -> monotonic time of the last heartbeat
    state: dict[str, str] = field(default_factory=dict)

    def observe(self, beat: Heartbeat, now: float) -> str:
        """Record a heartbeat; returns ``"ready"``, ``"draining"`` or ``"gone"`` for the worker."""
        if beat.routing != "dispatch":
            return "gone"
        if beat.state == "stopped":
            self.forget(beat.worker_id)
            return "gone"
        self.seen[beat.worker_id] = now
        self.state[beat.worker_id] = beat.state
        return "ready" if beat.state == "ready" else "draining"

    def silent(self, now: float) -> list[str]:
        """Workers not heard from within ``stale_after_s``: forgotten and returned."""
        gone = [w for w, seen in self.seen.items() if now - seen > self.stale_after_s]
        for worker in gone:
            self.forget(worker)
        return gone

    def forget(self, worker: str) -> None:
        self.seen.pop(worker, None)
        self.state.pop(worker, None)

    def __contains__(self, worker: object) -> bool:
        return worker in self.seen
