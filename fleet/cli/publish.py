"""``fleet publish``: read, validate, publish with a progress bar, print job ids."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from fleet.brokers import make_broker
from fleet.models import resolve_spec
from fleet.producers.publish import check_encoding, check_priority, check_tenant, prepare, publish_all, read_lines
from fleet.settings import FleetSettings

MAX_ERRORS_SHOWN = 20


async def publish_file(
    settings: FleetSettings,
    file: Path,
    model: str,
    *,
    requests: bool,
    concurrency: int,
    priority: str = "normal",
    encoding_format: str = "float",
    tenant: str | None = None,
) -> int:
    """Returns the exit code: 0 when every line was published, 1 when some lines were invalid.

    Raises ``InvalidInput`` when ``priority`` is not high, normal or low (nor an integer of -9..9), or when
    ``encoding_format`` is not float or base64 (or base64 for a model without vector outputs), or ``tenant`` is
    not a tenant's name.
    """
    err = Console(stderr=True)
    spec = resolve_spec(model)
    level = check_priority(priority)
    encoding = check_encoding(encoding_format, spec)
    owner = check_tenant(tenant)
    lines = sys.stdin.read().splitlines() if str(file) == "-" else read_lines(file)
    prepared = prepare(lines, spec, requests=requests, priority=level, encoding_format=encoding, tenant=owner)
    for problem in prepared.errors[:MAX_ERRORS_SHOWN]:
        err.print(f"[red]{file}:{problem.line}:[/] {problem.message}", highlight=False)
    if len(prepared.errors) > MAX_ERRORS_SHOWN:
        err.print(f"... and {len(prepared.errors) - MAX_ERRORS_SHOWN} more invalid lines")
    if not prepared.messages:
        err.print("nothing to publish")
        return 1 if prepared.errors else 0
    broker = make_broker(settings)
    await broker.connect()
    try:
        await broker.ensure_model(spec.name)
        columns = (TextColumn("publishing"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, console=err, transient=False) as progress:
            task = progress.add_task("publish", total=len(prepared.messages))
            ids = await publish_all(
                broker, prepared.messages, concurrency=concurrency, on_published=lambda: progress.advance(task)
            )
    finally:
        await broker.close()
    sys.stdout.write("".join(f"{job_id}\n" for job_id in ids))
    err.print(
        f"published {len(ids)} requests to {spec.name}"
        + (f", {len(prepared.errors)} lines invalid" if prepared.errors else "")
    )
    return 1 if prepared.errors else 0
