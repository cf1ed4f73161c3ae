"""Logging set-up, called only by the CLI: human-readable lines on stderr, repeats held back.

A service outage makes clients log the same line over and over (aiokafka about 130 ERROR lines a second per
process while Kafka is down). ``RepeatLimiter`` lets through at most a few lines of each message template of a
logger per window (Fleet's own: ``FLEET_BURST``; a third-party library's: ``CLIENT_BURST``) and notes on the next
line of that template let through how many it held back. Fleet itself says when an outage starts and ends
(``fleet.outages``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

NOISY_LOGGERS = ("aiokafka", "nats", "httpx", "uvicorn.access", "transformers", "urllib3", "faiss")
FLEET_PACKAGES = ("fleet",)  # every Fleet module is fleet.*
REPEAT_WINDOW_S = 60.0
FLEET_BURST = 10  # lines of one Fleet message template per window
CLIENT_BURST = 2  # lines of one third-party message template per window
MAX_TEMPLATES = 2_000  # templates remembered; older windows are forgotten beyond it


@dataclass(slots=True)
class _Window:
    start: float
    shown: int = 1
    held: int = 0


class RepeatLimiter(logging.Filter):
    """Let through at most ``burst`` records of each (logger, level, message template) per ``window_s``."""

    def __init__(
        self,
        window_s: float = REPEAT_WINDOW_S,
        fleet_burst: int = FLEET_BURST,
        client_burst: int = CLIENT_BURST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.window_s, self.fleet_burst, self.client_burst, self._clock = window_s, fleet_burst, client_burst, clock
        self._windows: dict[tuple[str, int, str], _Window] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        now = self._clock()
        window = self._windows.get(key)
        if window is None or now - window.start >= self.window_s:
            if len(self._windows) >= MAX_TEMPLATES:
                self._forget(now)
            self._windows[key] = _Window(now)
            if window is not None and window.held:
                record.msg = f"{record.msg} [{window.held} more like this held back in {self.window_s:.0f}s]"
            return True
        if window.shown < self._burst(record.name):
            window.shown += 1
            return True
        window.held += 1
        return False

    def _burst(self, name: str) -> int:
        own = name.split(".", 1)[0] in FLEET_PACKAGES
        return self.fleet_burst if own else self.client_burst

    def _forget(self, now: float) -> None:
        self._windows = {k: w for k, w in self._windows.items() if now - w.start < self.window_s}
        if len(self._windows) >= MAX_TEMPLATES:
            self._windows.clear()


def configure_logging(level: str = "INFO") -> None:
    """Human-readable logs on stderr; third-party chatter held at WARNING unless DEBUG is asked for, and repeated
    lines held back (``RepeatLimiter``) unless DEBUG is asked for."""
    from rich.logging import RichHandler  # imported by the commands that log, not by `fleet --help`

    handler = RichHandler(rich_tracebacks=True, show_path=False, markup=False)
    if level != "DEBUG":
        handler.addFilter(RepeatLimiter())
    logging.basicConfig(level=level, format="%(name)s: %(message)s", datefmt="[%X]", handlers=[handler], force=True)
    if level != "DEBUG":
        for name in NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
