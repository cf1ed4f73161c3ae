"""`fleet models traffic show | set | clear | comparisons NAME`: a model's traffic policy on a running gateway.

They talk to the gateway at ``--url`` (env ``FLEET_URL``) over its operator API (``/v1/models/{name}/traffic``,
``fleet.producers.gateway.models.traffic``) with ``--api-key`` (env ``FLEET_API_KEY``): an operator key, or the
operator token. ``set`` builds the policy from its flags and checks it here first (``TrafficPolicy``), so a bad
weight or a canary that is the primary is refused before anything is sent; the gateway then checks that each
version exists. Every failure is one ``error: ...`` line: exit 2 for a bad flag, 1 for a refusal or an unreachable
gateway.

    fleet models traffic set extract --primary 1 --canary 2 --weight 0.1 --shadow 3 --shadow-share 0.2 --sticky tenant
"""

# No ``from __future__ import annotations``: typer evaluates the commands' annotations.
import json
from typing import Annotated, Any

import typer

from fleet.cli.common import DEFAULT_URL, Url, fail
from fleet.cli.model_ops import ApiKey, Name, call

traffic_app = typer.Typer(
    help="A model's traffic policy on the gateway: canary weight, sticky A/B, shadow.", no_args_is_help=True
)


def sticky_of(value: str) -> dict[str, Any]:
    """``none``, ``tenant``, ``field:NAME`` or ``header:NAME`` as a ``StickyKey``'s fields; raises the exit of a
    bad flag otherwise."""
    source, _, name = value.partition(":")
    if source in ("none", "tenant") and not name:
        return {"source": source}
    if source in ("field", "header") and name:
        return {"source": source, "name": name}
    raise fail(f"--sticky: expected none, tenant, field:NAME or header:NAME, got {value!r}")


def policy_of(
    primary: str, canary: str | None, weight: float, shadow: str | None, share: float, sticky: str
) -> dict[str, Any]:
    """The policy the flags describe, validated here (exit 2 naming the problem)."""
    from pydantic import ValidationError

    from fleet.lifecycle.traffic import TrafficPolicy

    fields = {
        "primary": primary,
        "canary": canary,
        "canary_weight": weight,
        "shadow": shadow,
        "shadow_share": share,
        "sticky": sticky_of(sticky),
    }
    try:
        return TrafficPolicy.model_validate(fields).model_dump(mode="json", exclude_none=True)
    except ValidationError as exc:
        problems = "; ".join(_problem(e) for e in exc.errors())
        raise fail(f"invalid traffic policy: {problems}") from None


def _problem(error: Any) -> str:
    where = ".".join(map(str, error["loc"])) or "policy"
    return f"{where}: {str(error['msg']).removeprefix('Value error, ')}"


def _print(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, sort_keys=True))


@traffic_app.command("show")
def show_cmd(name: Name, url: Url = DEFAULT_URL, api_key: ApiKey = None) -> None:
    """Print the model's traffic policy, controller and breaker state (JSON)."""
    _print(call(url, api_key, lambda fleet: fleet.get_traffic(name)))


@traffic_app.command("set")
def set_cmd(
    name: Name,
    primary: Annotated[str, typer.Option("--primary", help="the version that answers by default")],
    canary: Annotated[str | None, typer.Option("--canary", help="a candidate version that answers a share")] = None,
    weight: Annotated[float, typer.Option("--weight", help="the canary's share of requests, 0..1")] = 0.0,
    shadow: Annotated[str | None, typer.Option("--shadow", help="a version that also computes, never answers")] = None,
    shadow_share: Annotated[float, typer.Option("--shadow-share", help="share of requests mirrored, 0..1")] = 0.0,
    sticky: Annotated[
        str, typer.Option("--sticky", help="the sticky key: none, tenant, field:NAME or header:NAME")
    ] = "none",
    auto: Annotated[
        bool, typer.Option("--auto/--manual", help="let the controller step the canary up (default thresholds)")
    ] = False,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
) -> None:
    """Set the model's traffic policy (printed back as the gateway stored it)."""
    policy = policy_of(primary, canary, weight, shadow, shadow_share, sticky)
    rollout: dict[str, Any] | None = {} if auto else None
    _print(call(url, api_key, lambda fleet: fleet.set_traffic(name, policy, rollout)))


@traffic_app.command("clear")
def clear_cmd(name: Name, url: Url = DEFAULT_URL, api_key: ApiKey = None) -> None:
    """Remove the model's traffic policy: every job goes to its served version again."""
    call(url, api_key, lambda fleet: fleet.clear_traffic(name))
    typer.echo(f"{name}: traffic policy removed")


@traffic_app.command("comparisons")
def comparisons_cmd(
    name: Name,
    limit: Annotated[int, typer.Option("--limit", min=1, max=200, help="how many, newest first")] = 20,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
) -> None:
    """Print the model's recent shadow comparisons (JSON lines: both jobs, versions, digests, score)."""
    for entry in call(url, api_key, lambda fleet: fleet.comparisons(name, limit)):
        typer.echo(json.dumps(entry, sort_keys=True))


def register_traffic(models_app: typer.Typer) -> None:
    models_app.add_typer(traffic_app, name="traffic")
