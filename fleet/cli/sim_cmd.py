"""`fleet sim`: the discrete-event load-balancing simulator (``fleet.dispatcher.sim_engine``), as a table or JSON."""

# No ``from __future__ import annotations``: typer evaluates the command's annotations.
import json
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from rich.progress import Progress

    from fleet.dispatcher.sim_engine import SimConfig

DEFAULT_LOADS = "0.5,0.7,0.9"
SIM_HELP = (
    "Simulate load-balancing policies and print mean, P50, P99 and P99/P50 response time per policy and load.\n\n"
    "Times are in units of the mean service time (a job of mean size takes 1 on a speed-1 worker); the load is the "
    "arrival rate over the total capacity (the sum of worker speeds). Each point runs --jobs Poisson arrivals "
    "through m dispatchers running the live dispatcher's policy code; pull is one central queue (the broker "
    "baseline).\n\n"
    "Columns idle, amnesia and fallback are the shares of assignments made through idle tokens, the amnesia list "
    "and at random. --analytic adds the large-system mean where a formula exists: random (M/M/1, M/D/1, M/G/1), "
    "power-of-d with one dispatcher (Mitzenmacher), jiq-random and jiq-sq (Lu et al.), pull (M/M/n, Erlang C)."
)


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_policies(text: str | None) -> list[str]:
    """The policies to run, in order (all of them, pull included, when ``text`` is None).

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    from fleet.dispatcher.policies import POLICY_NAMES

    if text is None:
        return list(POLICY_NAMES)
    names = _split(text)
    unknown = [name for name in names if name not in POLICY_NAMES]
    if not names:
        raise ValueError(f"--policies names no policy; known: {', '.join(POLICY_NAMES)}")
    if unknown:
        raise ValueError(f"unknown policy {', '.join(map(repr, unknown))}; known: {', '.join(POLICY_NAMES)}")
    return names


def parse_loads(text: str) -> list[float]:
    """Loads as fractions of capacity, each strictly between 0 and 1.

    Raises:
        ValueError: a value that is not a number or not in (0, 1).
    """
    loads = []
    for part in _split(text) or [""]:
        try:
            load = float(part)
        except ValueError:
            raise ValueError(f"--loads: {part!r} is not a number (write e.g. 0.5,0.7,0.9)") from None
        if not 0 < load < 1:
            raise ValueError(f"--loads: {part} is not between 0 and 1 (a load of 1 or more has no steady state)")
        loads.append(load)
    return loads


def _progress_bar() -> "Progress":
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )


def _run_with_progress(configs: "list[SimConfig]", with_analytic: bool) -> list[dict[str, Any]]:
    from fleet.dispatcher.sim_report import run_grid

    total = sum(c.jobs for c in configs)
    with _progress_bar() as bar:
        task = bar.add_task("simulating", total=total)
        done = 0

        def on_point(config: "SimConfig") -> Any:
            nonlocal done
            bar.update(task, completed=done, description=f"{config.policy} @ {config.load:g}")
            start = done
            done += config.jobs
            return lambda arrivals: bar.update(task, completed=start + arrivals)

        rows = run_grid(configs, with_analytic=with_analytic, on_point=on_point)
        bar.update(task, completed=total)
    return rows


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _print_table(rows: list[dict[str, Any]], title: str, with_analytic: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    columns = ["policy", "load", "mean", "p50", "p99", "p999", "p99/p50", "idle", "amnesia", "fallback", "jobs"]
    if with_analytic:
        columns += ["analytic", "sim/analytic"]
    for name in columns:
        table.add_column(name, justify="left" if name == "policy" else "right")
    for row in rows:
        cells = [row["policy"] + (" (unstable)" if row["unstable"] else ""), f"{row['load']:g}"]
        cells += [_fmt(row[k]) for k in ("mean", "p50", "p99", "p999")] + [_fmt(row["p99_p50"], 2)]
        cells += [f"{row[k]:.0%}" for k in ("idle_share", "amnesia_share", "fallback_share")] + [f"{row['jobs']:,}"]
        if with_analytic:
            analytic = row.get("analytic")
            cells += [_fmt(analytic), "-" if analytic is None else f"{row['mean'] / analytic - 1:+.1%}"]
        table.add_row(*cells)
    # Piped output has no width of its own; keep the table whole there instead of squeezing it to 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    if any(row["unstable"] for row in rows):
        console.print(
            "(unstable): work piled up during the run (some worker got more than it can serve, e.g. slow workers "
            "picked at random), so these times grow with --jobs and are no steady state."
        )


def _title(base: "SimConfig") -> str:
    speeds = "all speed 1" if base.speeds is None else f"speeds {min(base.speeds):g}..{max(base.speeds):g}"
    service = f"lognormal sigma={base.sigma:g}" if base.service == "lognormal" else base.service
    return (
        f"n={base.servers} workers ({speeds}), m={base.dispatchers} dispatchers, {service} service, d={base.d}, "
        f"seed {base.seed}; times in mean service times"
    )


def register(app: typer.Typer) -> None:
    from fleet.cli.common import fail

    @app.command(help=SIM_HELP)
    def sim(
        policies: Annotated[
            str | None,
            typer.Option(
                help="comma-separated policies: random, round-robin, power-of-d, least-outstanding, peak-ewma, "
                "jiq-random, jiq-sq, jiq-amnesia, jiq-sed, pull (default: all)"
            ),
        ] = None,
        loads: Annotated[
            str, typer.Option(help="comma-separated loads: arrival rate over total capacity, each in (0, 1)")
        ] = DEFAULT_LOADS,
        servers: Annotated[
            int | None, typer.Option(help="n, the number of workers (default 100, or the count in --speeds)")
        ] = None,
        dispatchers: Annotated[
            int, typer.Option(help="m, the number of dispatchers, each with its own state (pull has none)")
        ] = 10,
        jobs: Annotated[int, typer.Option(help="arrivals per point; the first 10% warm up and are not counted")] = (
            200_000
        ),
        service: Annotated[
            str, typer.Option(help="job size distribution with mean 1: exponential, deterministic or lognormal")
        ] = "exponential",
        seed: Annotated[int, typer.Option(help="random seed: the same seed gives the same numbers")] = 1,
        d: Annotated[
            int, typer.Option("--d", help="sample size of power-of-d, peak-ewma, JIQ-SQ(d) and the amnesia list")
        ] = 2,
        speeds: Annotated[
            str | None,
            typer.Option(
                help="worker speeds as SPEEDxCOUNT,... e.g. 1x6,0.333x2 (six workers at full speed, two 3x "
                "slower); scaled to --servers when that differs; default all 1"
            ),
        ] = None,
        sigma: Annotated[float, typer.Option(help="shape of the lognormal service time (its log's std dev)")] = 1.0,
        analytic: Annotated[
            bool, typer.Option("--analytic", help="add the large-system analytic mean where a formula exists")
        ] = False,
        as_json: Annotated[bool, typer.Option("--json", help="print a JSON list of rows instead of a table")] = False,
    ) -> None:
        try:
            base, names, load_list = _build(
                policies, loads, servers, dispatchers, jobs, service, seed, d, speeds, sigma
            )
        except ValueError as exc:
            raise fail(str(exc)) from None
        _run(base, names, load_list, analytic=analytic, as_json=as_json)


def _build(
    policies: str | None,
    loads: str,
    servers: int | None,
    dispatchers: int,
    jobs: int,
    service: str,
    seed: int,
    d: int,
    speeds: str | None,
    sigma: float,
) -> "tuple[SimConfig, list[str], list[float]]":
    """Validate the flags into a base config, the policy names and the loads (``ValueError`` says what is wrong)."""
    from fleet.dispatcher.sim_engine import SERVICE_DISTS, SimConfig
    from fleet.dispatcher.sim_report import parse_speeds

    names, load_list = parse_policies(policies), parse_loads(loads)
    if servers is not None and servers < 1:
        raise ValueError(f"--servers must be at least 1, got {servers}")
    checks = [
        (dispatchers >= 1, f"--dispatchers must be at least 1, got {dispatchers}"),
        (jobs >= 100, f"--jobs must be at least 100, got {jobs}"),
        (service in SERVICE_DISTS, f"--service {service!r} is not one of {', '.join(SERVICE_DISTS)}"),
        (d >= 1, f"--d must be at least 1, got {d}"),
        (sigma > 0, f"--sigma must be positive, got {sigma}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    speed_list = parse_speeds(speeds, servers) if speeds is not None else None
    n = len(speed_list) if speed_list is not None else (servers or 100)
    base = SimConfig(
        policy=names[0],
        load=load_list[0],
        servers=n,
        dispatchers=dispatchers,
        jobs=jobs,
        service=service,  # type: ignore[arg-type]  # checked above
        sigma=sigma,
        d=d,
        speeds=tuple(speed_list) if speed_list is not None else None,
        seed=seed,
    )
    return base, names, load_list


def _run(base: "SimConfig", names: list[str], loads: list[float], *, analytic: bool, as_json: bool) -> None:
    from fleet.dispatcher.sim_report import grid, run_grid

    configs = grid(base, names, loads)
    if as_json:
        typer.echo(json.dumps(run_grid(configs, with_analytic=analytic), indent=2))
    elif sys.stdout.isatty():  # a table for a person: show progress (on stderr, gone when done)
        _print_table(_run_with_progress(configs, analytic), _title(base), analytic)
    else:
        _print_table(run_grid(configs, with_analytic=analytic), _title(base), analytic)
