"""`fleet usage`: jobs, items, device-seconds and cost per tenant, model, version or device kind, from a gateway
(``--url``, env ``FLEET_URL``) through ``GET /v1/usage``, as a table.

A tenant's key (``--api-key`` / ``FLEET_API_KEY``) sees its own tenant's usage; the operator token (or an operator
key of the default tenant) every tenant's. Every failure is one ``error: ...`` line: exit 2 for a bad flag (checked
here, before any call), 1 when the gateway refuses (its 422 names the bad value) or cannot be reached.
"""

# No ``from __future__ import annotations``: typer evaluates the command's annotations.
from typing import TYPE_CHECKING, Annotated

import typer

from fleet.cli.common import DEFAULT_URL, Url, api_key_option, fail
from fleet.cli.model_ops import call

if TYPE_CHECKING:
    from fleet.schemas.usage import UsageReport, UsageRow

FIELDS = ("tenant", "model", "version", "device")
ApiKey = Annotated[
    str | None,
    api_key_option("an API key (its tenant's usage) or the operator token (every tenant's); prefer the variable"),
]


def usage(
    group_by: Annotated[
        str, typer.Option("--group-by", "-g", help="comma-separated: tenant, model, version, device")
    ] = "model",
    since: Annotated[
        str | None, typer.Option("--from", help="unix seconds, ISO 8601 or a time ago (24h, 7d); default 24h")
    ] = None,
    until: Annotated[str | None, typer.Option("--to", help="unix seconds, ISO 8601 or a time ago; default now")] = None,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
) -> None:
    """Show usage and cost (device-seconds priced by FLEET_PRICE_PER_DEVICE_HOUR on the gateway), largest first."""
    fields = [f.strip() for f in group_by.split(",") if f.strip()]
    bad = [f for f in fields if f not in FIELDS]
    if bad or not fields or len(set(fields)) != len(fields):
        raise fail(f"--group-by {group_by!r}: name each of {', '.join(FIELDS)} at most once, separated by commas")
    report = call(url, api_key, lambda fleet: fleet.usage(fields, since=since, until=until))
    for line in table(report):
        typer.echo(line)


def table(report: "UsageReport") -> list[str]:
    """The report as aligned lines: a header, one line per row, a total, and the window it covers."""
    from datetime import UTC, datetime

    fields: list[str] = list(report.group_by)
    header = (*fields, "jobs", "items", "device-s", f"cost {report.currency}", "per 1k jobs")
    lines = [header, *(_cells(row, fields) for row in report.rows), _cells(report.total, fields, total=True)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = [_aligned(line, widths, len(fields)) for line in lines]
    start, end = (datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M") for t in (report.from_, report.to))
    prices = ", ".join(f"{k} {v:g}" for k, v in sorted(report.prices.items())) or "none set"
    out.append(f"{start} to {end} UTC; price per device-hour: {prices}")
    return out


def _aligned(cells: tuple[str, ...], widths: list[int], names: int) -> str:
    """Names left-aligned, numbers right-aligned."""
    padded = (c.ljust(w) if i < names else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
    return "  ".join(padded).rstrip()


def _cells(row: "UsageRow", fields: list[str], total: bool = False) -> tuple[str, ...]:
    names = ["total" if total and i == 0 else "" if total else str(getattr(row, f)) for i, f in enumerate(fields)]
    per_1k = "-" if row.cost_per_1k_requests is None else f"{row.cost_per_1k_requests:.4f}"
    return (*names, str(row.jobs), str(row.items), f"{row.device_seconds:.3f}", f"{row.cost:.4f}", per_1k)


def register(app: typer.Typer) -> None:
    app.command("usage")(usage)
