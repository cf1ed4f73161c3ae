"""``fleet sim`` reproduces the queueing results it claims to, is deterministic per seed, and refuses bad flags.

Each comparison runs one fixed seed at a size where the spread of the simulated mean over seeds is about a
quarter of the tolerance (measured over five seeds when the sizes were chosen), so a pass is not luck.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from typer.testing import CliRunner, Result

from fleet.cli import app
from fleet.dispatcher import analytic
from fleet.dispatcher.sim_engine import SimConfig, simulate
from fleet.dispatcher.sim_report import grid, parse_speeds, result_row, run_grid
from tests.processes import run_fleet

HETEROGENEOUS = tuple(parse_speeds("1x6,0.333x2"))


def relative_error(simulated: float, expected: float) -> float:
    return abs(simulated / expected - 1)


# -- simulated means against closed forms ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "expected", "tolerance"),
    [
        # random dispatch splits Poisson arrivals: every server is M/M/1 (spread over seeds 1.2%)
        (SimConfig("random", 0.7, servers=50, jobs=300_000), analytic.mm1_mean(0.7), 0.05),
        # ... and M/D/1 with constant service times (spread 1%)
        (SimConfig("random", 0.7, servers=20, jobs=300_000, service="deterministic"), analytic.md1_mean(0.7), 0.04),
        # ... and M/G/1 (Pollaczek-Khinchine) with lognormal ones, E[S^2] = e (spread 1.2%)
        (
            SimConfig("random", 0.6, servers=50, jobs=300_000, service="lognormal", sigma=1.0),
            analytic.mg1_mean(0.6, math.e),
            0.05,
        ),
        # one dispatcher sees every queue: power-of-2 is SQ(2); Mitzenmacher's limit (n = 200: bias +0.7%, spread 0.8%)
        (SimConfig("power-of-d", 0.9, servers=200, jobs=300_000), analytic.sqd_mean(0.9, 2), 0.04),
        # the central queue is M/M/n: Erlang C, exact at n = 10 (spread 1%)
        (SimConfig("pull", 0.8, servers=10, jobs=200_000), analytic.mmn_mean(0.8, 10), 0.04),
    ],
    ids=["random-mm1", "random-md1", "random-mg1-lognormal", "sq2", "pull-erlang-c"],
)
def test_simulated_mean_matches_the_closed_form(config: SimConfig, expected: float, tolerance: float) -> None:
    result = simulate(config)
    assert result.jobs == int(config.jobs * 0.9)
    assert relative_error(result.mean, expected) < tolerance, (result.mean, expected)


def test_jiq_random_follows_lu_et_al_and_the_exact_limit_with_retraction() -> None:
    """r = n / m = 20 at 80% load. Lu et al.'s formula ignores random jobs reaching servers that wait in an idle
    queue and overestimates the mean by about 2% here (4.4% at r = 5, 90%); the mean-field limit of the retracting
    protocol (``jiq_random_retract_mean``) is within 0.4% (spread 0.4%)."""
    result = simulate(SimConfig("jiq-random", 0.8, servers=500, dispatchers=25, jobs=300_000))
    assert relative_error(result.mean, analytic.jiq_random_mean(0.8, 20)) < 0.04
    assert relative_error(result.mean, analytic.jiq_random_retract_mean(0.8, 20)) < 0.015
    lu_idle_share = 20 * 0.2 / (1 + 20 * 0.2)  # share of non-empty idle queues, Lu et al.
    assert abs(result.route_share("idle") - lu_idle_share) < 0.03
    assert result.route_share("idle") + result.route_share("fallback") == pytest.approx(1.0)


def test_without_retraction_stale_tokens_send_work_to_busy_workers() -> None:
    base = SimConfig("jiq-random", 0.5, servers=100, dispatchers=20, jobs=60_000)
    retracting, stale = simulate(base), simulate(replace(base, retract=False))
    assert stale.mean > retracting.mean * 1.05


def test_the_analytic_formulas_agree_where_they_meet() -> None:
    assert analytic.jiq_sq_mean(0.8, 10, 1) == pytest.approx(analytic.jiq_random_mean(0.8, 10))
    assert analytic.sqd_mean(0.8, 1) == pytest.approx(analytic.mm1_mean(0.8))
    assert analytic.mmn_mean(0.8, 1) == pytest.approx(analytic.mm1_mean(0.8))  # M/M/1 is M/M/n with n = 1
    assert analytic.mg1_mean(0.8, 2.0) == pytest.approx(analytic.mm1_mean(0.8))
    assert analytic.jiq_random_retract_mean(0.8, 20) < analytic.jiq_random_mean(0.8, 20)
    assert analytic.analytic_mean("power-of-d", 0.8, servers=100, dispatchers=4) is None  # not SQ(d) with m > 1
    assert analytic.analytic_mean("jiq-amnesia", 0.8, servers=100, dispatchers=4) is None
    assert analytic.analytic_mean("random", 0.8, servers=8, dispatchers=2, homogeneous=False) is None


# -- heterogeneous workers ---------------------------------------------------------------------------------------


def test_jiq_amnesia_beats_random_at_the_tail_with_slow_workers() -> None:
    """8 workers, two of them 3x slower, two dispatchers: the amnesia list steers the fallback to fast workers.
    Random sends each slow worker 1/8 of the work, 2.5 x load of what it can do: past 40% load it never catches up."""
    base = SimConfig("random", 0.3, servers=8, dispatchers=2, jobs=60_000, speeds=HETEROGENEOUS)
    rows = {(row["policy"], row["load"]): row for row in run_grid(grid(base, ["random", "jiq-amnesia"], [0.3, 0.7]))}
    assert rows["jiq-amnesia", 0.3]["p99"] < rows["random", 0.3]["p99"] / 2
    assert not rows["random", 0.3]["unstable"] and not rows["jiq-amnesia", 0.7]["unstable"]
    assert rows["random", 0.7]["unstable"] and rows["random", 0.7]["backlog"] > 1000
    assert rows["jiq-amnesia", 0.7]["p99"] < 20 and rows["jiq-amnesia", 0.7]["amnesia_share"] > 0.1


@pytest.mark.parametrize(
    ("spec", "servers", "expected"),
    [
        ("1x6,0.333x2", None, [1.0] * 6 + [0.333] * 2),
        ("1/3x2,2", None, [1 / 3, 1 / 3, 2.0]),
        ("1x3,0.5x1", 8, [1.0] * 6 + [0.5] * 2),
        ("1x6,0.333x2", 1000, [1.0] * 750 + [0.333] * 250),
    ],
)
def test_speeds_are_parsed_and_scaled_to_the_server_count(
    spec: str, servers: int | None, expected: list[float]
) -> None:
    assert parse_speeds(spec, servers) == pytest.approx(expected)


def test_load_is_relative_to_the_total_capacity() -> None:
    """Half-speed workers at the same load see arrivals at half the rate: every time doubles."""
    full = simulate(SimConfig("random", 0.6, servers=20, jobs=50_000, service="deterministic"))
    half = simulate(SimConfig("random", 0.6, servers=20, jobs=50_000, service="deterministic", speeds=(0.5,) * 20))
    assert half.mean == pytest.approx(2 * full.mean, rel=1e-9)


# -- determinism, progress, rows ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["jiq-amnesia", "pull"])
def test_the_same_seed_gives_the_same_numbers(policy: str) -> None:
    config = SimConfig(policy, 0.7, servers=30, dispatchers=3, jobs=20_000, service="lognormal", seed=7)
    first, again = simulate(config), simulate(config)
    assert first.samples.tolist() == again.samples.tolist() and first.routes == again.routes
    other = simulate(SimConfig(policy, 0.7, servers=30, dispatchers=3, jobs=20_000, service="lognormal", seed=8))
    assert other.samples.tolist() != first.samples.tolist()


def test_progress_is_reported_up_to_the_last_arrival() -> None:
    seen: list[int] = []
    simulate(SimConfig("jiq-sq", 0.5, servers=10, dispatchers=2, jobs=50_000), progress=seen.append)
    assert seen == sorted(seen) and seen[0] == 0 and seen[-1] == 50_000 and len(seen) > 2


def test_a_row_carries_the_statistics_and_the_analytic_mean() -> None:
    row = result_row(simulate(SimConfig("jiq-random", 0.5, servers=40, dispatchers=4, jobs=5_000)), with_analytic=True)
    assert row["p50"] <= row["p99"] <= row["p999"] and row["p99_p50"] == pytest.approx(row["p99"] / row["p50"])
    assert row["analytic"] == pytest.approx(analytic.jiq_random_mean(0.5, 10))
    assert row["analytic_retract"] == pytest.approx(analytic.jiq_random_retract_mean(0.5, 10))
    assert row["idle_share"] + row["fallback_share"] == pytest.approx(1.0) and row["jobs"] == 4_500


# -- the command -------------------------------------------------------------------------------------------------

SMALL = ["--servers", "20", "--dispatchers", "2", "--jobs", "3000"]


def fleet_sim(*args: str) -> Result:
    """``fleet sim`` in this process (the table test below runs the real entry point)."""
    return CliRunner().invoke(app, ["sim", *args])


def test_json_output_is_a_list_of_rows_per_policy_and_load() -> None:
    result = fleet_sim("--json", "--policies", "random,jiq-amnesia,pull", "--loads", "0.5,0.9", *SMALL)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(r["policy"], r["load"]) for r in rows] == [
        (p, load) for p in ("random", "jiq-amnesia", "pull") for load in (0.5, 0.9)
    ]
    for row in rows:
        assert {"policy", "load", "mean", "p50", "p99", "p99_p50", "idle_share", "jobs"} <= set(row)
        assert 0 < row["p50"] <= row["p99"] and row["mean"] > 0
    assert "analytic" not in rows[0]


def test_json_with_the_same_seed_is_reproducible() -> None:
    args = ("--json", "--policies", "jiq-sq", "--loads", "0.8", "--service", "lognormal", *SMALL)
    first, again, other = (json.loads(fleet_sim(*args, "--seed", seed).stdout) for seed in ("5", "5", "6"))
    assert [row["p99"] for row in first] == [row["p99"] for row in again] != [row["p99"] for row in other]
    strip = [{k: v for k, v in row.items() if k != "wall_s"} for row in first]
    assert strip == [{k: v for k, v in row.items() if k != "wall_s"} for row in again]


@pytest.mark.services
def test_the_table_names_the_setup_and_the_analytic_column() -> None:
    result = run_fleet("sim", "--policies", "random", "--loads", "0.7", "--analytic", *SMALL)
    assert result.returncode == 0, result.stderr
    assert "n=20 workers" in result.stdout and "m=2 dispatchers" in result.stdout
    assert "p99/p50" in result.stdout and "3.333" in result.stdout  # M/M/1 at 70%: 1 / 0.3


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--policies", "random,fastest"], "unknown policy 'fastest'; known: random"),
        (["--policies", " , "], "--policies names no policy; known: random"),
        (["--loads", "0.5,1.0"], "--loads: 1.0 is not between 0 and 1"),
        (["--loads", "0"], "--loads: 0 is not between 0 and 1"),
        (["--loads", "half"], "--loads: 'half' is not a number"),
        (["--servers", "0"], "--servers must be at least 1"),
        (["--dispatchers", "0"], "--dispatchers must be at least 1"),
        (["--jobs", "10"], "--jobs must be at least 100"),
        (["--service", "pareto"], "--service 'pareto' is not one of exponential, deterministic, lognormal"),
        (["--speeds", "1x6,fastx2"], "bad speed group 'fastx2'"),
        (["--speeds", "1x6,0x2"], "the speed must be > 0"),
        (["--speeds", "1x1,2x1,3x1", "--servers", "2"], "3 speed groups do not fit in 2 servers"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(args: list[str], expected: str) -> None:
    result = fleet_sim(*args)
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.stderr.split())
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.services
def test_a_bad_flag_from_the_shell_exits_2_without_a_traceback() -> None:
    result = run_fleet("sim", "--loads", "0.5,1")
    assert result.returncode == 2 and "--loads: 1 is not between 0 and 1" in result.stderr
    assert "Traceback" not in result.stderr
