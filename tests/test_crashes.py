"""The crash rule (``fleet.consumers.crashes``) is pure: tables of cases."""

from __future__ import annotations

import pytest

from fleet.consumers.crashes import RAW_RUNS_FACTOR, Blame, OutOfRuns, after_vanished, out_of_runs, plan


@pytest.mark.parametrize(
    ("strikes", "batch_size", "blame"),
    [
        (0, 1, Blame(1, 1)),  # it computed alone and its worker vanished: evidence
        (2, 1, Blame(3, 1)),
        (0, 2, Blame(0, 1)),  # one of two: not evidence, but the next run is alone
        (0, 3, Blame(0, 1)),
        (0, 16, Blame(0, 8)),  # one of many: bisection
        (1, 64, Blame(1, 32)),  # strikes already counted stay
        (0, 0, Blame(0, None)),  # its worker was draining: no evidence, no bound
        (3, 0, Blame(3, None)),
        (0, None, Blame(0, None)),  # a record from before the rule
    ],
)
def test_a_vanished_run_is_evidence_only_when_the_job_ran_alone(
    strikes: int, batch_size: int | None, blame: Blame
) -> None:
    assert after_vanished(strikes, batch_size) == blame


@pytest.mark.parametrize(
    ("strikes", "attempt", "runs_allowed", "out"),
    [
        (0, 1, 5, None),
        (4, 5, 5, None),
        (5, 6, 5, OutOfRuns.strikes),  # the poison cap: five runs alone that killed their worker
        (1, 2, 1, OutOfRuns.strikes),  # a DAG step with no retries
        (0, 6, 5, None),  # five crashes in batches of many: not the job's fault
        (0, RAW_RUNS_FACTOR * 5, 5, None),
        (0, RAW_RUNS_FACTOR * 5 + 1, 5, OutOfRuns.runs),  # the last resort, whatever ended the runs
        (4, RAW_RUNS_FACTOR * 5 + 1, 5, OutOfRuns.runs),
        (0, 2, 1, None),
        (0, RAW_RUNS_FACTOR + 1, 1, OutOfRuns.runs),
    ],
)
def test_out_of_runs(strikes: int, attempt: int, runs_allowed: int, out: OutOfRuns | None) -> None:
    assert out_of_runs(strikes, attempt, runs_allowed) is out


@pytest.mark.parametrize(
    ("bounds", "runs"),
    [
        ([], []),
        ([None], [[0]]),
        ([None, None, None], [[0, 1, 2]]),  # the normal path: one run
        ([1, None, None], [[0], [1, 2]]),
        ([None, 1, None, 1], [[1], [3], [0, 2]]),
        ([2, 2, 2, 2], [[0, 1], [2, 3]]),
        ([2, 2, 2], [[0, 1], [2]]),
        ([4, None, None, None, None, None], [[0, 1, 2, 3], [4, 5]]),  # the bounded run takes unbounded company
        ([8, 2, None, 8, 2, None], [[1, 4], [0, 2, 3, 5]]),  # tightest first, each run within its first's bound
        ([3, 1, 3, 3, 3], [[1], [0, 2, 3], [4]]),
    ],
)
def test_plan_keeps_every_job_within_its_bound(bounds: list[int | None], runs: list[list[int]]) -> None:
    got = plan(bounds)
    assert got == runs
    assert sorted(i for run in got for i in run) == list(range(len(bounds)))
    assert all(len(run) <= (bounds[i] or len(bounds)) for run in got for i in run)
