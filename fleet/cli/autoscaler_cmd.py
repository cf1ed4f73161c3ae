"""`fleet autoscaler`: scales workers on queue lag."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this module's command to ``app`` (not yet built)."""
