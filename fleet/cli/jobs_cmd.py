"""`fleet jobs list | submit`: the job history of a gateway as a table (or JSON), and many jobs from a JSON Lines file.

Both talk to the gateway at ``--url`` through the SDK (``GET /v1/jobs``, ``POST /v1/jobs:batch``). Every failure is
one line on stderr: exit 2 for a bad argument (a file that cannot be read), 1 for a refusal of the gateway (its
message, e.g. a bad filter or another tenant's listing) or a gateway that cannot be reached.
"""

# No ``from __future__ import annotations``: typer evaluates the commands' annotations.
import asyncio
import json
from collections.abc import Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from fleet import constants as c
from fleet import strict_json
from fleet.cli.common import DEFAULT_URL, Url, api_key_option
from fleet.errors import FleetError

jobs_app = typer.Typer(help="Jobs: list the history, submit many at once.", no_args_is_help=True)
err = Console(stderr=True)

ApiKey = Annotated[
    str | None,
    api_key_option("an API key for a gateway with FLEET_AUTH=keys; prefer the variable (a flag shows in ps)"),
]
STATE_STYLES = {"queued": "dim", "running": "yellow", "succeeded": "green", "failed": "bold red"}


def _out() -> Console:
    """Standard output, sized when a command prints (the terminal's width, or COLUMNS), not when it is imported."""
    return Console()


def _fail(message: str, code: int) -> typer.Exit:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _call(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        return asyncio.run(coro)
    except FleetError as exc:
        raise _fail(exc.message, 1) from None


def _when(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S")


def jobs_table(jobs: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    table.add_column("job", overflow="fold")  # whole, even on a narrow terminal: it is what one copies
    for column in ("model", "state", "tenant", "created (UTC)", "took", "error"):
        table.add_column(column)
    for job in jobs:
        started, finished = job.get("started_at"), job.get("finished_at")
        took = f"{finished - started:.3f}s" if started is not None and finished is not None else "-"
        state = job["state"]
        error = (job.get("error") or {}).get("type", "")
        style = STATE_STYLES.get(state, "magenta")
        model = job["model"] + (f"@{job['version']}" if job.get("version") else "")
        table.add_row(
            job["job_id"], model, f"[{style}]{state}[/]", job["tenant"], _when(job["created_at"]), took, error
        )
    return table


async def _list(url: str, api_key: str | None, filters: dict[str, Any], pages: int) -> dict[str, Any]:
    from fleet.producers.sdk import FleetClient

    jobs: list[dict[str, Any]] = []
    cursor = filters.pop("cursor", None)
    async with FleetClient(url, api_key=api_key) as fleet:
        for _ in range(pages):
            page = await fleet.list_jobs(**filters, cursor=cursor)
            jobs += [j.model_dump(mode="json", exclude_none=True) for j in page.jobs]
            cursor = page.next_cursor
            if cursor is None:
                break
    return {"jobs": jobs, "next_cursor": cursor}


async def _submit(url: str, api_key: str | None, items: list[Any]) -> dict[str, Any]:
    from fleet.producers.sdk import FleetClient

    async with FleetClient(url, api_key=api_key) as fleet:
        answer = await fleet.submit_many(items)
    return answer.model_dump(mode="json", exclude_none=True)


def read_items(path: Path) -> tuple[list[Any], list[int]]:
    """The jobs of a JSON Lines file (one ``POST /v1/jobs`` body per non-empty line) and their line numbers. Exit 2
    naming the line that is not JSON."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise _fail(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}", 2) from None
    items, lines = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                items.append(strict_json.loads(line, f"{path} line {number}"))
            except strict_json.JsonRefused as exc:
                raise _fail(exc.message, 2) from None
            lines.append(number)
    if not items:
        raise _fail(f"{path} holds no jobs (one JSON object per line)", 2)
    return items, lines


@jobs_app.command("list")
def list_cmd(
    model: Annotated[str | None, typer.Option("--model", help="only this model's jobs")] = None,
    state: Annotated[
        str | None, typer.Option("--state", help="only these states, comma-separated (e.g. failed,expired)")
    ] = None,
    tenant: Annotated[str | None, typer.Option("--tenant", help="another tenant (operators only)")] = None,
    since: Annotated[str | None, typer.Option("--since", help="created at or after: unix seconds or RFC 3339")] = None,
    until: Annotated[str | None, typer.Option("--until", help="created at or before: unix seconds or RFC 3339")] = None,
    limit: Annotated[
        int, typer.Option("--limit", min=1, max=c.JOB_LIST_MAX_LIMIT, help="jobs per page")
    ] = c.JOB_LIST_DEFAULT_LIMIT,
    pages: Annotated[int, typer.Option("--pages", min=1, max=1000, help="pages to read at most")] = 1,
    cursor: Annotated[str | None, typer.Option("--cursor", help="go on from a listing's next_cursor")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the page(s) as JSON")] = False,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
) -> None:
    """List the gateway's jobs, newest first: your tenant's (an operator: any tenant's, or every tenant's). Prints a
    table, and the cursor to go on from when more remain."""
    named = {"model": model, "state": state, "tenant": tenant, "since": since, "until": until}
    filters: dict[str, Any] = {k: v for k, v in named.items() if v is not None}
    filters |= {"limit": limit, "cursor": cursor}
    shown = _call(_list(url, api_key, filters, pages))
    if as_json:
        typer.echo(json.dumps(shown, indent=2))
        return
    if not shown["jobs"]:
        _out().print("no jobs match", highlight=False)
    else:
        _out().print(jobs_table(shown["jobs"]))
    if shown["next_cursor"]:
        _out().print(f"more: --cursor {shown['next_cursor']}", highlight=False, soft_wrap=True)


@jobs_app.command("submit")
def submit_cmd(
    file: Annotated[Path, typer.Option("--file", "-f", help="JSON Lines: one POST /v1/jobs body per line")],
    as_json: Annotated[bool, typer.Option("--json", help="print the gateway's answer as JSON")] = False,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
) -> None:
    """Submit every job of a JSON Lines file in batches (POST /v1/jobs:batch): prints each line's job id or error,
    and exits 1 when any was refused."""
    items, lines = read_items(file)
    answer = _call(_submit(url, api_key, items))
    if as_json:
        typer.echo(json.dumps(answer, indent=2))
    else:
        for item in answer["items"]:
            if item["status"] < 300:
                line = lines[item["index"]]
                _out().print(f"line {line}: {item['job_id']} {item.get('state', '')}", highlight=False)
            else:
                error = item["error"]
                err.print(
                    f"line {lines[item['index']]}: {item['status']} {error['type']}: {error['message']}",
                    highlight=False,
                    markup=False,
                    soft_wrap=True,
                )
        _out().print(f"{answer['accepted']} accepted, {answer['refused']} refused", highlight=False)
    if answer["refused"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(jobs_app, name="jobs")
