"""`fleet dag validate | show | run`: check a DAG file, draw its graph in the terminal, run it on a gateway.

A FILE is read and validated here; a NAME is a DAG registered on the gateway at ``--url``. Every failure is one
line on stderr and a non-zero exit: 1 for a spec that is refused or a run that did not succeed, 2 for a bad
argument (a file that cannot be read, ``--input`` that is not JSON), 1 for a gateway that cannot be reached.
"""

# No ``from __future__ import annotations``: typer evaluates the commands' annotations.
import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from fleet import strict_json
from fleet.cli.common import DEFAULT_URL, Url, api_key_option
from fleet.errors import DagInvalid, FleetError

if TYPE_CHECKING:  # rich's tables are imported by the commands that draw them
    from rich.table import Table

STATE_STYLES = {
    "pending": "dim",
    "running": "yellow",
    "succeeded": "green",
    "failed": "bold red",
    "skipped": "cyan",
    "cancelled": "magenta",
    "expired": "magenta",
}

dag_app = typer.Typer(help="DAG workflows: validate a spec, show its graph, run it.", no_args_is_help=True)
out = Console()
err = Console(stderr=True)

ApiKey = Annotated[
    str | None,
    api_key_option("an API key for a gateway with FLEET_AUTH=keys; prefer the variable (a flag shows in ps)"),
]
Models = Annotated[
    str | None,
    typer.Option("--models", help="comma-separated models beyond the built-in ones ('package.module:Handler')"),
]


def _fail(message: str, code: int) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False, markup=True, soft_wrap=True)
    return typer.Exit(code)


def _refused(exc: DagInvalid) -> typer.Exit:
    for problem in exc.problems:
        err.print(DagInvalid.line(problem), highlight=False, markup=False, soft_wrap=True)
    return typer.Exit(1)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise _fail(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}", 2) from None


def is_file(target: str) -> bool:
    """A target is a file when it exists or looks like a path: a DAG's name has no '/' or '.'."""
    return Path(target).exists() or "/" in target or "." in target


def compile_file(path: Path, models: str | None) -> Any:
    """The ``CompiledDag`` of a file, validated against the built-in models and ``models``."""
    from fleet.dags.spec import load_spec
    from fleet.dags.validate import validate
    from fleet.models import resolve_specs
    from fleet.schemas.models import BUILTIN_SPECS

    text = _read(path)
    try:
        extra = resolve_specs([m.strip() for m in models.split(",") if m.strip()]) if models else {}
        return validate(load_spec(text), {**BUILTIN_SPECS, **extra})
    except DagInvalid as exc:
        raise _refused(exc) from None
    except FleetError as exc:
        raise _fail(exc.message, 2) from None


def graph_of(dag: Any) -> dict[str, Any]:
    from fleet.dags import graph

    return {"name": dag.spec.name, "nodes": graph.nodes(dag), "edges": graph.edges(dag), "mermaid": graph.mermaid(dag)}


def steps_table(shown: dict[str, Any]) -> "Table":
    """One row per step: its model, what it waits for, its fan-out and its condition."""
    deps: dict[str, list[str]] = {}
    for edge in shown["edges"]:
        deps.setdefault(edge["to"], []).append(edge["from"] if edge["kind"] == "data" else f"{edge['from']} (after)")
    from rich.table import Table

    table = Table(title=f"DAG {shown['name']}", title_justify="left")
    for column in ("step", "model", "after", "for_each", "when", "on_error"):
        table.add_column(column, overflow="fold")
    for node in shown["nodes"]:
        table.add_row(
            node["id"],
            node["model"],
            ", ".join(deps.get(node["id"], [])) or "-",
            node.get("for_each") or "-",
            node.get("when") or "-",
            node.get("on_error") or "fail",
        )
    return table


def progress_table(view: dict[str, Any]) -> "Table":
    """The live display of ``dag run --wait``: each step's state and how many of its jobs have a result."""
    state = view["state"]
    from rich.table import Table

    table = Table(title=f"{view['dag']}: [{STATE_STYLES.get(state, '')}]{state}[/]", title_justify="left")
    table.caption = f"run {view['run_id']}"
    for column in ("step", "state", "items", "error"):
        table.add_column(column, overflow="fold")
    for sid, step in view["steps"].items():
        items = step.get("items") or {"total": len(step["job_ids"]), "done": 0}
        error = step.get("error") or {}
        table.add_row(
            sid,
            f"[{STATE_STYLES.get(step['state'], '')}]{step['state']}[/]",
            f"{items['done']}/{items['total']}" if items["total"] else "-",
            str(error.get("message", "")),
        )
    return table


async def _fetch_graph(url: str, name: str, api_key: str | None) -> dict[str, Any]:
    from fleet.producers.sdk import FleetClient

    async with FleetClient(url, api_key=api_key) as fleet:
        shown = await fleet.get_dag(name)
    return {"name": shown["name"], **shown["graph"], "mermaid": shown["mermaid"]}


async def _run(
    url: str,
    target: str,
    spec: str | None,
    run_input: Any,
    run_id: str | None,
    timeout_s: float | None,
    wait: bool,
    api_key: str | None = None,
    version: int | None = None,
) -> int:
    """Register ``spec`` (a file's text) or run the DAG named ``target``."""
    from fleet.producers.sdk import FleetClient

    async with FleetClient(url, api_key=api_key) as fleet:
        name = (await fleet.register_dag(spec))[0] if spec is not None else target
        run_id = await fleet.start_run(name, run_input, run_id=run_id, timeout_s=timeout_s, version=version)
        if not wait:
            out.print(run_id, highlight=False)
            return 0
        view = await fleet.get_run(run_id)
        from rich.live import Live

        with Live(progress_table(view), console=err, refresh_per_second=8, transient=False) as live:
            async for event in fleet.run_events(run_id):
                view = event["run"]
                live.update(progress_table(view))
    out.print_json(json.dumps(view["output"]))
    if view["state"] != "succeeded":
        error = view.get("error") or {}
        err.print(f"run {run_id} ended {view['state']}: {error.get('message', '')}", highlight=False, markup=False)
        return 1
    return 0


def _call(coro: Any) -> Any:
    try:
        return asyncio.run(coro)
    except DagInvalid as exc:
        raise _refused(exc) from None
    except FleetError as exc:
        raise _fail(exc.message, 1) from None


@dag_app.command("validate")
def validate_cmd(
    file: Annotated[Path, typer.Argument(help="the DAG spec, YAML or JSON")],
    models: Models = None,
) -> None:
    """Load and validate a DAG file: prints `ok: NAME, N steps`, or each problem on its own line (exit 1)."""
    dag = compile_file(file, models)
    out.print(f"ok: {dag.spec.name}, {len(dag.steps)} steps", highlight=False)


@dag_app.command("show")
def show_cmd(
    target: Annotated[str, typer.Argument(help="a DAG file, or the name of a DAG registered on the gateway")],
    mermaid: Annotated[bool, typer.Option("--mermaid", help="print the graph as Mermaid text")] = False,
    models: Models = None,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
) -> None:
    """Show a DAG's steps (model, dependencies, for_each, when) as a table, or as Mermaid with `--mermaid`."""
    shown = (
        graph_of(compile_file(Path(target), models)) if is_file(target) else _call(_fetch_graph(url, target, api_key))
    )
    if mermaid:
        typer.echo(shown["mermaid"], nl=False)
    else:
        out.print(steps_table(shown))


@dag_app.command("run")
def run_cmd(
    target: Annotated[str, typer.Argument(help="a DAG file (registered first) or a registered DAG's name")],
    input: Annotated[str, typer.Option("--input", "-i", help="the run's input as JSON")] = "{}",
    wait: Annotated[bool, typer.Option("--wait", help="follow the run step by step and print its output")] = False,
    run_id: Annotated[str | None, typer.Option("--run-id", help="idempotency key of the run")] = None,
    timeout_s: Annotated[float | None, typer.Option("--timeout-s", help="the run expires after this long")] = None,
    version: Annotated[
        int | None, typer.Option("--version", min=1, help="the DAG version to run (default: the latest)")
    ] = None,
    url: Url = DEFAULT_URL,
    api_key: ApiKey = None,
) -> None:
    """Start a run on the gateway and print its id; with `--wait`, show each step's progress live, then print the
    run's output as JSON (exit 1 when the run did not succeed)."""
    try:
        run_input = strict_json.loads(input, "--input")
    except strict_json.JsonRefused as exc:  # not JSON, or a value JSON cannot carry exactly
        raise _fail(exc.message, 2) from None
    spec = _read(Path(target)) if is_file(target) else None
    raise typer.Exit(_call(_run(url, target, spec, run_input, run_id, timeout_s, wait, api_key, version)))


def register(app: typer.Typer) -> None:
    app.add_typer(dag_app, name="dag")
