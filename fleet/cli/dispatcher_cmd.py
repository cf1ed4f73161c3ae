"""`fleet dispatcher`: direct assignment of requests to workers (JIQ and other policies)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this module's command to ``app`` (not yet built)."""
