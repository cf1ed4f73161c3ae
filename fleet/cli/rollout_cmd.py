"""`fleet models promote NAME`, `fleet models rollback NAME` and `fleet models rollout NAME`: a model's canary on a
gateway (``--url``, env ``FLEET_URL``), through ``POST /v1/models/{name}/promote`` and ``/rollback`` and
``GET /v1/models/{name}/rollout`` (operator role: ``--api-key`` / ``FLEET_API_KEY``, an operator key or the operator
token).

A promote or rollback is carried out at once and named on the model's timeline and in the audit log. Every failure
is one ``error: ...`` line: exit 1 when the gateway refuses (no such model or policy, no canary: 409, a key without
the operator role) or cannot be reached, 2 for a bad argument.

``register_rollouts(models_app)`` adds the commands to the ``fleet models`` sub-app (``fleet.cli.models_cmd``).
"""

# No ``from __future__ import annotations``: typer evaluates the commands' annotations.

import typer

from fleet.cli.common import DEFAULT_URL, Url, fail
from fleet.cli.model_ops import ApiKey, Name, call


def _pct(fraction: float) -> str:
    return f"{fraction * 100:.4g} %"


def _check(name: str) -> None:
    from fleet import constants as c

    if not c.MODEL_NAME_RE.match(name):
        raise fail(f"NAME {name!r} is not a model name (lower-case letters, digits, '-' and '_', at most 63)")


def promote(name: Name, url: Url = DEFAULT_URL, api_key: ApiKey = None) -> None:
    """Promote NAME's canary to primary now, whatever its measurements say."""
    _check(name)
    view = call(url, api_key, lambda fleet: fleet.promote(name))
    typer.echo(f"{name}: {view['decisions'][0]['reason']}; primary is now {view['doc']['policy']['primary']}")


def rollback(name: Name, url: Url = DEFAULT_URL, api_key: ApiKey = None) -> None:
    """Roll NAME's canary back to weight 0 now; the primary answers everything."""
    _check(name)
    view = call(url, api_key, lambda fleet: fleet.rollback(name))
    typer.echo(f"{name}: {view['decisions'][0]['reason']}; primary {view['doc']['policy']['primary']} answers all")


def rollout(name: Name, url: Url = DEFAULT_URL, api_key: ApiKey = None) -> None:
    """Show NAME's versions (role, share, requests, error rate, p99, agreement, breaker) and its latest decisions."""
    _check(name)
    view = call(url, api_key, lambda fleet: fleet.rollout(name))
    rows = [("version", "role", "share", "requests", "errors", "p99 ms", "agreement", "breaker")]
    for v in view["versions"]:
        agreement = "-" if v["agreement"] is None else f"{v['agreement']:.3f} ({v['agreement_samples']})"
        p99 = "-" if v["p99_ms"] is None else f"{v['p99_ms']:.1f}"
        rows.append(
            (v["version"], v["role"], _pct(v["share"]), str(v["requests"]), _pct(v["error_rate"]), p99, agreement,
             v["breaker"]["status"])
        )  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    state = view["doc"]["state"]
    typer.echo(f"controller: {state['phase'].replace('_', ' ')}, window {view['window_s']:g}s")
    for entry in view["decisions"][:10]:
        typer.echo(f"  {entry['action']:<9} {entry['by']}: {entry['reason']}")


def register_rollouts(models_app: typer.Typer) -> None:
    """Add ``promote``, ``rollback`` and ``rollout`` to ``fleet models``."""
    models_app.command("promote")(promote)
    models_app.command("rollback")(rollback)
    models_app.command("rollout")(rollout)
