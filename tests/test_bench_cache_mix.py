"""bench_cache's pure parts: the mix a workload plans (as the gateway fills its levels), the throughput bound with
a cheaper L3 embedder, and the seeds' preset under explicit flags."""

from __future__ import annotations

import pytest

from benchmarks.bench_cache import SEEDS_PRESET, ceiling, parse_args
from benchmarks.cache_workload import SEEDS_MIX, SEEDS_WORKLOAD, expected_levels, requests
from benchmarks.catalogue import EXTRACT, by_name, missing


def test_the_planned_mix_follows_how_the_gateway_fills_its_levels() -> None:
    workload = [(1, "a"), (1, "a"), (1, "a!"), (2, "b"), (1, "a"), (1, "a!"), (3, "c")]
    # a: miss; a: L1; a!: L3 (family 1 computed); b: miss (evicts a from the 1-entry L1); a: L2 (computed);
    # a!: L3 again (an L3 hit fills L1 only, never L2, and L1 now holds a); c: miss
    assert expected_levels(workload, l1_entries=1) == {"l1": 1 / 7, "l2": 1 / 7, "l3": 2 / 7, "miss": 3 / 7}


def test_the_seeds_workload_plans_the_seeds_mix_within_two_points() -> None:
    workload = requests(
        SEEDS_WORKLOAD["requests"],
        zipf_s=SEEDS_WORKLOAD["zipf_s"],
        paraphrase_share=SEEDS_WORKLOAD["paraphrase_share"],
        pool=SEEDS_WORKLOAD["pool"],
    )
    planned = expected_levels(workload, SEEDS_WORKLOAD["l1_entries"])
    assert all(abs(planned[level] - SEEDS_MIX[level]) < 0.02 for level in SEEDS_MIX), planned


@pytest.mark.parametrize(
    ("lookup_cost", "bound"),
    [(1.0, 1 / (0.37 + 0.25)), (0.1, 1 / (0.037 + 0.25)), (0.0, 4.0)],
)
def test_the_bound_at_the_seeds_mix_grows_as_the_embedder_gets_cheaper(lookup_cost: float, bound: float) -> None:
    assert ceiling(SEEDS_MIX, True, lookup_cost) == pytest.approx(bound)


def test_the_seeds_preset_sets_the_workload_and_explicit_flags_win() -> None:
    args = parse_args(["--model", "extract", "--mix", "seeds", "--rounds", "3", "--pool", "100"])
    assert (args.requests, args.zipf_s, args.l1_entries) == (1000, 0.85, 40)
    assert (args.concurrency, args.rounds, args.pool) == (SEEDS_PRESET["concurrency"], 3, 100)
    assert (args.model_ref, args.repository) == ("extract", "models")  # the repository entry, by the runtime
    assert parse_args(["--model", "extract", "--model-ref", "extract@2"]).model_ref == "extract@2"
    plain = parse_args([])
    assert (plain.model, plain.model_ref, plain.requests, plain.pool) == ("embed", "embed", 20_000, None)


def test_the_extract_benchmarks_are_skipped_with_the_command_that_builds_it() -> None:
    assert by_name()["bench_cache_extract"].needs == by_name()["stand_in_cost"].needs == EXTRACT
    why = missing(EXTRACT)  # the checkout holds no models/extract/1 (440 MB, built, never committed)
    assert why is not None and "fleet models synth deberta-v2-base --task token-classification --name extract" in why
