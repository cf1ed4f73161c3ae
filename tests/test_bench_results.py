"""Benchmark result files: the envelope written and read back, the benchmarks page rendered from a folder of them,
and a malformed file refused with the file and field named. Pure: no servers, no benchmark runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import catalogue, common, envelope
from benchmarks.catalogue import BENCHMARKS
from benchmarks.report import NOT_MEASURED, render_markdown
from benchmarks.run_all import Outcome, select, summary


@pytest.fixture
def shown(monkeypatch: pytest.MonkeyPatch) -> list[envelope.Table]:
    """A fresh list of printed tables, as a benchmark process starts with."""
    tables: list[envelope.Table] = []
    monkeypatch.setattr(common, "SHOWN", tables)
    return tables


def write_sample(path: Path, argv: list[str] | None = None) -> Path:
    common.show("throughput, one run", [("fleet / raw", "0.93", ">= 0.9"), ("fleet jobs/s", "9,300", "")])
    common.show("latency", [("p99 (ms)", "12.5", "<= 10")])
    figures = {"ratio": 0.93, "jobs_per_s": {"fleet": 9300.0, "raw": 10000.0}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common.sys, "argv", argv or ["/repo/benchmarks/bench_pipeline.py", "--jobs", "100"])
        return common.write_result("pipeline", figures, path)


def test_a_result_is_written_in_the_envelope_and_read_back(tmp_path: Path, shown: list[envelope.Table]) -> None:
    path = write_sample(tmp_path / "pipeline.json")
    result = envelope.read_result(path)
    assert result.benchmark == "pipeline"
    assert result.figures == {"ratio": 0.93, "jobs_per_s": {"fleet": 9300.0, "raw": 10000.0}}
    assert result.command == "python -m benchmarks.bench_pipeline --jobs 100"
    assert result.started <= result.date
    assert [t.title for t in result.tables] == ["throughput, one run", "latency"]
    assert [r.measure for r in result.headlines] == ["fleet / raw", "p99 (ms)"]
    assert result.machine["cores"] >= 1 and result.machine["memory_bytes"] > 0
    assert result.machine["cpu_model"]
    assert len(result.machine["load_average_start"]) == 3 and len(result.machine["load_average_end"]) == 3
    assert result.versions["python"].count(".") == 2
    assert result.versions["fleet"] and result.versions["nats-py"] and result.versions["redis"]
    assert json.loads(path.read_text())["schema"] == envelope.SCHEMA_VERSION


def test_the_report_renders_measured_and_unmeasured_benchmarks(tmp_path: Path, shown: list[envelope.Table]) -> None:
    write_sample(tmp_path / "pipeline.json")
    page = render_markdown(tmp_path)
    pipeline = page.split("## pipeline\n", 1)[1].split("\n## ", 1)[0]
    assert "| fleet / raw | 0.93 | >= 0.9 | yes |" in pipeline
    assert "| p99 (ms) | 12.5 | <= 10 | no |" in pipeline
    assert "fleet jobs/s" not in pipeline  # context rows stay in the file; the page shows the headlines
    assert "cores" in pipeline and "`python -m benchmarks.bench_pipeline --jobs 100`" in pipeline
    assert "a shorter or different run than `make bench`'s `python -m benchmarks.bench_pipeline`" in pipeline
    assert NOT_MEASURED not in pipeline
    for benchmark in BENCHMARKS:
        assert f"## {benchmark.name}\n" in page
    assert page.count(NOT_MEASURED) == len(BENCHMARKS) - 1
    assert "load_average" not in page and "dirty" not in page  # user docs carry no load averages or commits


def test_the_report_of_an_empty_or_missing_folder_says_not_measured(tmp_path: Path) -> None:
    assert render_markdown(tmp_path / "nowhere").count(NOT_MEASURED) == len(BENCHMARKS)


def test_a_result_file_of_no_listed_benchmark_gets_its_own_section(tmp_path: Path, shown: list[envelope.Table]) -> None:
    path = write_sample(tmp_path / "x.json")
    document = json.loads(path.read_text())
    path.write_text(json.dumps({**document, "benchmark": "gateway_attacks-orig"}))
    assert "## gateway_attacks-orig\n" in render_markdown(tmp_path)


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ("date", "is missing the field 'date'"),
        ("machine.cores", "is missing the field 'machine.cores'"),
        ("versions.torch", "is missing the field 'versions.torch'"),
    ],
)
def test_a_result_file_missing_a_field_is_refused_by_name(
    tmp_path: Path, shown: list[envelope.Table], field: str, message: str
) -> None:
    path = write_sample(tmp_path / "pipeline.json")
    document = json.loads(path.read_text())
    parent, _, key = field.rpartition(".")
    del (document[parent] if parent else document)[key]
    path.write_text(json.dumps(document))
    with pytest.raises(envelope.ResultFileError, match="run the benchmark again") as caught:
        render_markdown(tmp_path)
    assert str(caught.value).startswith(f"{path}: {message}")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"schema": 99}, "has schema 99, this reader knows schema 1"),
        ({"figures": [1, 2]}, "has 'figures' of type list, expected dict"),
        ({"tables": [{"title": "t", "rows": [{"measure": "m"}]}]}, "has tables[0].rows[0] without 'measure'"),
    ],
)
def test_a_result_file_of_another_shape_is_refused(
    tmp_path: Path, shown: list[envelope.Table], change: dict[str, object], message: str
) -> None:
    path = write_sample(tmp_path / "pipeline.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(envelope.ResultFileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        envelope.read_result(path)


def test_a_result_file_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(envelope.ResultFileError, match="cannot be read as JSON"):
        envelope.read_result(path)


def test_the_committed_result_files_render() -> None:
    """Every file in benchmarks/results/ is in the current envelope (a benchmark writing its own shape fails here)."""
    page = render_markdown(Path(common.RESULTS_DIR))
    assert page.startswith("# Benchmarks\n")


def test_the_catalogue_names_each_result_file_once_and_every_module_exists() -> None:
    names = [b.name for b in BENCHMARKS]
    assert len(names) == len(set(names))
    root = Path(common.__file__).parent
    for benchmark in BENCHMARKS:
        assert (root / f"{benchmark.module.rsplit('.', 1)[1]}.py").is_file(), benchmark.module


def test_the_run_summary_says_what_ran_what_was_skipped_and_where_results_are() -> None:
    first, second, third = BENCHMARKS[:3]
    text = summary(
        [
            Outcome(first, "ok", 12.0),
            Outcome(second, "skipped: needs a CUDA GPU"),
            Outcome(third, "failed (exit 2)", 3.0),
        ]
    )
    assert f"{first.name}" in text and "ok in 12 s" in text
    assert "skipped: needs a CUDA GPU" in text
    assert "1 ran, 1 skipped, 1 failed; results in " in text and str(common.RESULTS_DIR) in text


def test_an_unknown_benchmark_name_is_refused_with_the_known_ones() -> None:
    with pytest.raises(SystemExit, match="unknown benchmark\\(s\\): nope; known: startup, pipeline"):
        select("pipeline,nope")


def test_a_benchmark_needing_what_the_machine_lacks_is_skipped_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(catalogue.shutil, "which", lambda name: None)
    assert "needs valgrind" in (catalogue.missing(catalogue.VALGRIND) or "")
    assert "needs a CUDA GPU" in (catalogue.missing(catalogue.GPU) or "")
    assert catalogue.missing(None) is None
