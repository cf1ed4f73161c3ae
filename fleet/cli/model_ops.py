"""What the commands that act on a model through a running gateway share (``fleet models traffic``, ``promote``,
``rollback``, ``rollout``): the ``--url`` and ``--api-key`` options, the model-name argument, and ``call``, which runs
one SDK call and turns a refusal or an unreachable gateway into one ``error: ...`` line and exit 1.

A model's traffic is every tenant's, so these routes take the operator token or an operator key of the default
tenant (``require_fleet_operator`` in the gateway).
"""

# No ``from __future__ import annotations``: typer evaluates the commands' annotations.
import asyncio
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import typer

from fleet.cli.common import api_key_option, fail

Name = Annotated[str, typer.Argument(help="the model's name")]
ApiKey = Annotated[
    str | None,
    api_key_option(
        "the operator token or an operator key of the default tenant; prefer the variable (a flag shows in ps)"
    ),
]


def call(url: str, api_key: str | None, action: Callable[[Any], Awaitable[Any]]) -> Any:
    """``await action(client)`` on a ``FleetClient`` of the gateway at ``url``; a ``FleetError`` is one line, exit 1."""
    from fleet.errors import FleetError
    from fleet.producers.sdk import FleetClient

    async def run() -> Any:
        async with FleetClient(url, api_key=api_key) as fleet:
            return await action(fleet)

    try:
        return asyncio.run(run())
    except FleetError as exc:
        raise fail(exc.message, 1) from None
