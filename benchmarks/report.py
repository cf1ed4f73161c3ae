"""The benchmarks page, rendered from the result files in ``benchmarks/results/``.

    python -m benchmarks.report [--results DIR]     # prints the page as Markdown

One section per benchmark of ``benchmarks.catalogue``: what it measures, its headline figures against their
targets, the machine and the date; a benchmark without a result file says "not measured yet". The docs build
calls ``render_markdown`` from a hook. Standard library only.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from benchmarks.catalogue import BENCHMARKS, Benchmark
from benchmarks.envelope import Result, ResultFileError, Row, read_results

RESULTS_DIR = Path(__file__).resolve().parent / "results"
NOT_MEASURED = "Not measured yet"
INTRO = """\
# Benchmarks

Each benchmark writes its figures, the machine it ran on and the versions it ran with to a JSON file in
`benchmarks/results/`; this page is generated from those files. `make bench` runs every benchmark the machine can
(those needing a GPU or valgrind are skipped where missing, and say so); `python -m benchmarks.run_all --list` lists
them. Ratios compare two sides measured in the same run on the same machine, so they travel between machines
better than absolute rates, which depend on the machine and its load.
"""
COMPARISON = re.compile(r"^\s*(>=|<=|>|<|==)\s*([-+0-9.eE,]+)\s*[x%]?\s*$")
NUMBER = re.compile(r"^\s*([-+0-9.eE,]+)\s*[x%]?\s*$")


def met(row: Row) -> str:
    """Whether ``row.value`` meets ``row.target`` when both read as numbers (``0.93x`` against ``>= 0.9``), or as
    the same word (``True`` against ``True``); empty when the target is prose the page cannot judge."""
    target = COMPARISON.match(row.target)
    value = NUMBER.match(row.value)
    if target and value:
        try:
            bound, got = float(target[2].replace(",", "")), float(value[1].replace(",", ""))
        except ValueError:
            return ""
        ok = {">=": got >= bound, "<=": got <= bound, ">": got > bound, "<": got < bound, "==": got == bound}
        return "yes" if ok[target[1]] else "no"
    if row.target in ("True", "False") and row.value in ("True", "False"):
        return "yes" if row.value == row.target else "no"
    return ""


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def headline_table(rows: list[Row]) -> list[str]:
    lines = ["| measure | value | target | met |", "| --- | --- | --- | --- |"]
    lines += [f"| {cell(r.measure)} | {cell(r.value)} | {cell(r.target)} | {met(r)} |" for r in rows]
    return lines


def machine_line(benchmark: Benchmark, result: Result) -> str:
    m = result.machine
    memory = f", {m['memory_bytes'] / 2**30:.0f} GiB memory" if m.get("memory_bytes") else ""
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ", no GPU"
    python = result.versions.get("python")
    line = (
        f"Measured on {result.date[:10]}: {m.get('cores')} cores ({m.get('cpu_model')}){memory}{gpu}; "
        f"Python {python}, with `{result.command}`"
    )
    if benchmark.module and result.command != benchmark.command:
        return f"{line}, a shorter or different run than `make bench`'s `{benchmark.command}`."
    return line + "."


def section(benchmark: Benchmark, result: Result | None) -> list[str]:
    lines = [f"## {benchmark.name}", "", benchmark.measures, ""]
    if result is None:
        how = f"`{benchmark.command}`" + (f" (needs {benchmark.needs})" if benchmark.needs else "")
        return [*lines, f"{NOT_MEASURED}: {how} writes `benchmarks/results/{benchmark.name}.json`.", ""]
    rows = result.headlines or [row for table in result.tables for row in table.rows]
    if rows:
        lines += [*headline_table(rows), ""]
    else:
        lines += ["This run printed no table; its figures are in the result file.", ""]
    return [*lines, machine_line(benchmark, result), ""]


def render_markdown(results_dir: Path) -> str:
    """The benchmarks page as Markdown, from the result files in ``results_dir``.

    Raises ``benchmarks.envelope.ResultFileError`` naming the file and the field when a result file is malformed.
    Result files of benchmarks the catalogue does not list get a section of their own at the end.
    """
    results = read_results(results_dir) if results_dir.is_dir() else {}
    known = {b.name for b in BENCHMARKS}
    extra = [Benchmark(name, "", (), "A result file no benchmark in the catalogue writes.") for name in results]
    lines = [INTRO]
    for benchmark in [*BENCHMARKS, *(b for b in extra if b.name not in known)]:
        lines += section(benchmark, results.get(benchmark.name))
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="the folder of result files")
    args = parser.parse_args()
    try:
        sys.stdout.write(render_markdown(args.results))
    except ResultFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
