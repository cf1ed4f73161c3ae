"""The pure pieces of ``benchmarks.bench_multimodel``: its Zipf traffic, its memory reading, its arguments."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import pytest

from benchmarks.bench_multimodel import job_input, memory_of, parse_args, pool_rows, smaps_rollup, zipf_choices


def test_zipf_traffic_favours_a_few_models_in_a_seeded_order() -> None:
    choices = zipf_choices(8, 20_000, 1.1, seed=7)
    counts = collections.Counter(choices)
    ranked = [n for _, n in counts.most_common()]
    assert set(counts) == set(range(8))
    assert ranked[0] / 20_000 == pytest.approx(1 / sum(1 / (r + 1) ** 1.1 for r in range(8)), abs=0.02)
    assert ranked[0] > 2 * ranked[3] > 0
    assert zipf_choices(8, 100, 1.1, seed=7) == zipf_choices(8, 100, 1.1, seed=7)
    assert [k for k, _ in counts.most_common(2)] != [0, 1], "the hottest models are a shuffle, not the first ones"


def test_memory_is_read_from_smaps_rollup() -> None:
    mine = smaps_rollup(os.getpid())
    assert 0 < mine["pss"] <= mine["rss"]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        both = memory_of([child, child])
        assert both["pss_bytes"] > 0 and both["rss_bytes"] >= both["pss_bytes"]
    finally:
        child.kill()
        child.wait()


def test_the_arguments_of_a_quick_run_and_a_bad_part() -> None:
    args = parse_args(["--quick"])
    assert args.counts == [2] and args.jobs == 200 and args.parts == ["replicas", "pool"]
    assert parse_args(["--counts", "4,8", "--parts", "replicas"]).counts == [4, 8]
    with pytest.raises(SystemExit):
        parse_args(["--parts", "replicas,gpus"])
    assert args.sides == ["pull", "dispatch", "dedicated"] and args.affinity_wait_s == 2.0
    assert parse_args(["--sides", "dispatch"]).sides == ["dispatch"]
    with pytest.raises(SystemExit):
        parse_args(["--sides", "pull,push"])


def test_the_pool_table_compares_the_sides_that_ran() -> None:
    def side(loads: float, p50: float, p99: float, pss: int) -> dict[str, object]:
        return {"cold_loads_per_1000": loads, "latency": {"p50_ms": p50, "p99_ms": p99}, "pss_bytes": pss}

    dispatch = {**side(20.0, 30, 300, 2 * 2**30), "dispatcher": {"cold_assignments": 40.0, "pss_bytes": 2**27}}
    rows = dict(
        (m, v)
        for m, v, _ in pool_rows(
            {"pull": side(200.0, 140, 2800, 2**31), "dispatch": dispatch, "dedicated": side(0.0, 20, 80, 2**32)}
        )
    )
    assert rows["p99 ms, pool-pull / dedicated"] == "35.0x (2,800 vs 80)"
    assert rows["p50 ms, pool-dispatch / dedicated"] == "1.5x (30 vs 20)"
    assert rows["PSS, pool-dispatch / dedicated"].startswith("0.50 ")
    assert rows["cold loads per 1,000 jobs, pool-pull vs pool-dispatch"] == "200.0 vs 20.0 (10.0x fewer with dispatch)"
    assert "the dispatcher's 128 MiB included" in rows["PSS, 2 multi-model workers (dispatch, affinity)"]
    alone = [m for m, _, _ in pool_rows({"dispatch": dispatch})]
    assert len(alone) == 3 and not any("dedicated" in m or "pool-pull" in m for m in alone), "no ratios alone"


def test_each_runtime_gets_an_input_of_its_shape() -> None:
    texts = ["a", "b", "c", "d", "e", "f"]
    assert job_input("embeddings", texts, 7) == {"text": "b"}
    assert job_input("rerank", texts, 0) == {"query": "a", "texts": ["b", "c", "d", "e"]}
