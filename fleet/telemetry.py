"""Logging set-up (called only by the CLI) and small Prometheus helpers."""

from __future__ import annotations

import logging

from rich.logging import RichHandler

NOISY_LOGGERS = ("aiokafka", "nats", "httpx", "uvicorn.access", "transformers", "urllib3", "faiss")


def configure_logging(level: str = "INFO") -> None:
    """Human-readable logs on stderr; third-party chatter held at WARNING unless DEBUG is asked for."""
    handler = RichHandler(rich_tracebacks=True, show_path=False, markup=False)
    logging.basicConfig(level=level, format="%(name)s: %(message)s", datefmt="[%X]", handlers=[handler], force=True)
    if level != "DEBUG":
        for name in NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
