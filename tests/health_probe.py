"""``HealthProbe``: a thread that polls a gateway's ``/healthz`` every few milliseconds, so that a test or a benchmark
can say how long the gateway's event loop kept it waiting while something else was going on.

It runs in its own thread with its own blocking client, so a busy caller's loop does not delay its probes, and
``worst(since)`` counts a probe still in flight at the moment of asking by how long it has been waiting: a loop that
is blocked is seen as blocked, not as silent.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

import httpx


class HealthProbe:
    """Poll ``<base>/healthz`` every ``interval_s`` in a thread; ``worst(since)`` is the longest wait (seconds) of
    the probes that were in flight at any time after ``since`` (a ``time.monotonic()`` value)."""

    def __init__(self, base: str, interval_s: float = 0.005) -> None:
        self.base = base
        self.interval_s = interval_s
        self.errors: list[str] = []
        self._probes: list[tuple[float, float]] = []  # (sent, answered), in order
        self._sent: float | None = None  # the probe in flight, if any
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="healthz-probe", daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(30)

    def worst(self, since: float) -> float:
        now = time.monotonic()
        with self._lock:
            finished = [end - start for start, end in reversed(self._probes) if end >= since]
            in_flight = [now - self._sent] if self._sent is not None else []
        return max([*finished, *in_flight], default=0.0)

    def settle(self, timeout_s: float = 60.0) -> None:
        """Wait until a probe sent from now on has been answered (so ``worst`` has seen the end of a stall)."""
        mark = time.monotonic()
        deadline = mark + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._probes and self._probes[-1][0] >= mark:
                    return
            time.sleep(self.interval_s)
        raise AssertionError(f"/healthz did not answer within {timeout_s:g}s")

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=120) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                with self._lock:
                    self._sent = start
                try:
                    status = client.get("/healthz").status_code
                    if status != 200:
                        self.errors.append(f"/healthz answered {status}")
                except httpx.HTTPError as exc:
                    self.errors.append(f"/healthz: {exc!r}")
                end = time.monotonic()
                with self._lock:
                    self._sent = None
                    self._probes.append((start, end))
                    if len(self._probes) > 100_000:
                        del self._probes[:50_000]
                self._stop.wait(self.interval_s)
