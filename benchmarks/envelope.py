"""The result file every benchmark writes: one JSON envelope, one schema, read back by ``benchmarks.report``.

A benchmark calls ``benchmarks.common.write_result(name, figures)``; the file lands in
``benchmarks/results/<name>.json`` (committed) and holds, beside the benchmark's own ``figures``:

* ``tables``: what the run printed with ``benchmarks.common.show``, each row a measure, its value and its target
  (empty when the row is context rather than a goal). Rows with a target are the headlines the report shows.
* ``machine``: cores, memory, CPU model, GPU (or null), and the load average when the run started and when it
  wrote its file: a ratio measured on a loaded machine says so next to itself.
* ``versions``: Python, Fleet's version and git commit (null outside a checkout), nats-py, aiokafka, redis, torch
  (null when not installed).
* ``command`` (as typed, ``python -m benchmarks.<module> ...``), ``started`` and ``date`` (UTC, ISO 8601).

This module uses only the standard library, so the docs build can read results without Fleet's dependencies.
``SCHEMA_VERSION`` changes when a field is renamed or removed; adding a field keeps it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
LIBRARIES = {"nats-py": "nats-py", "aiokafka": "aiokafka", "redis": "redis", "torch": "torch"}
REQUIRED_FIELDS: dict[str, type] = {
    "schema": int,
    "benchmark": str,
    "date": str,
    "started": str,
    "command": str,
    "machine": dict,
    "versions": dict,
    "tables": list,
    "figures": dict,
}
MACHINE_FIELDS = ("cores", "memory_bytes", "cpu_model", "gpu", "load_average_start", "load_average_end")
VERSION_FIELDS = ("python", "fleet", "commit", *LIBRARIES)
REPO_ROOT = Path(__file__).resolve().parent.parent


class ResultFileError(ValueError):
    """A result file that cannot be read: not JSON, another schema, or a field missing or of the wrong type."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(
            f"{path}: {problem}. Result files are written by benchmarks.common.write_result "
            f"(schema {SCHEMA_VERSION}); run the benchmark again to rewrite this one."
        )
        self.path = path
        self.problem = problem


@dataclass(frozen=True, slots=True)
class Row:
    measure: str
    value: str
    target: str


@dataclass(frozen=True, slots=True)
class Table:
    title: str
    rows: list[Row]


@dataclass(frozen=True, slots=True)
class Result:
    """One result file, read back and checked."""

    path: Path
    benchmark: str
    date: str
    started: str
    command: str
    machine: dict[str, Any]
    versions: dict[str, Any]
    tables: list[Table]
    figures: dict[str, Any]

    @property
    def headlines(self) -> list[Row]:
        """The rows measured against a target, across every table."""
        return [row for table in self.tables for row in table.rows if row.target]


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> str | None:
    """The first CUDA device's name: from torch when the benchmark already imported it, else from nvidia-smi."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return str(torch.cuda.get_device_name(0))
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def machine(load_at_start: list[float] | None) -> dict[str, Any]:
    return {
        "cores": os.cpu_count(),
        "memory_bytes": memory_bytes(),
        "cpu_model": cpu_model(),
        "gpu": gpu_name(),
        "platform": platform.platform(),
        "load_average_start": load_at_start,
        "load_average_end": load_average(),
    }


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def fleet_version() -> str | None:
    """The version in the checkout's pyproject.toml (the code that ran), else the installed distribution's."""
    try:
        with (REPO_ROOT / "pyproject.toml").open("rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return package_version("fleet-inference")


def git_commit() -> str | None:
    """HEAD of the checkout the benchmark ran from, with ``-dirty`` when tracked files were changed."""
    if shutil.which("git") is None:
        return None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def versions() -> dict[str, Any]:
    found = {library: package_version(dist) for library, dist in LIBRARIES.items()}
    return {"python": platform.python_version(), "fleet": fleet_version(), "commit": git_commit(), **found}


def command_line(argv: list[str]) -> str:
    """``sys.argv`` as it was typed: ``python -m benchmarks.bench_x --flag`` rather than the module's file path."""
    if not argv:
        return "python"
    first = Path(argv[0])
    if first.suffix == ".py" and first.parent.name == "benchmarks":
        head = f"python -m benchmarks.{first.stem}"
    else:
        head = f"python {argv[0]}"
    return " ".join([head, *argv[1:]])


def envelope(
    name: str,
    figures: dict[str, Any],
    tables: list[Table],
    *,
    started: str,
    load_at_start: list[float] | None,
    argv: list[str],
) -> dict[str, Any]:
    return {
        "schema": SCHEMA_VERSION,
        "benchmark": name,
        "date": now_iso(),
        "started": started,
        "command": command_line(argv),
        "machine": machine(load_at_start),
        "versions": versions(),
        "tables": [
            {"title": t.title, "rows": [{"measure": r.measure, "value": r.value, "target": r.target} for r in t.rows]}
            for t in tables
        ],
        "figures": figures,
    }


def write(path: Path, document: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")
    return path


def read_result(path: Path) -> Result:
    """Read one result file and check its envelope; raises ``ResultFileError`` naming the file and the problem."""
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ResultFileError(path, f"cannot be read as JSON ({exc})") from None
    if not isinstance(document, dict):
        raise ResultFileError(path, "holds JSON that is not an object")
    check_fields(path, document, REQUIRED_FIELDS, "")
    if document["schema"] != SCHEMA_VERSION:
        raise ResultFileError(path, f"has schema {document['schema']}, this reader knows schema {SCHEMA_VERSION}")
    check_fields(path, document["machine"], dict.fromkeys(MACHINE_FIELDS, object), "machine.")
    check_fields(path, document["versions"], dict.fromkeys(VERSION_FIELDS, object), "versions.")
    return Result(
        path=path,
        benchmark=document["benchmark"],
        date=document["date"],
        started=document["started"],
        command=document["command"],
        machine=document["machine"],
        versions=document["versions"],
        tables=[read_table(path, i, t) for i, t in enumerate(document["tables"])],
        figures=document["figures"],
    )


def check_fields(path: Path, document: dict[str, Any], fields: dict[str, type], prefix: str) -> None:
    for field, kind in fields.items():
        if field not in document:
            raise ResultFileError(path, f"is missing the field {prefix + field!r}")
        if kind is not object and not isinstance(document[field], kind):
            got = type(document[field]).__name__
            raise ResultFileError(path, f"has {prefix + field!r} of type {got}, expected {kind.__name__}")


def read_table(path: Path, index: int, table: Any) -> Table:
    where = f"tables[{index}]"
    if not (isinstance(table, dict) and isinstance(table.get("title"), str) and isinstance(table.get("rows"), list)):
        raise ResultFileError(path, f"has {where} without a 'title' string and a 'rows' list")
    rows = []
    for j, row in enumerate(table["rows"]):
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("measure", "value", "target")):
            raise ResultFileError(path, f"has {where}.rows[{j}] without 'measure', 'value' and 'target' strings")
        rows.append(Row(row["measure"], row["value"], row["target"]))
    return Table(table["title"], rows)


def read_results(results_dir: Path) -> dict[str, Result]:
    """Every ``*.json`` under ``results_dir`` (not its sub-folders, which hold logs), by benchmark name."""
    found: dict[str, Result] = {}
    for path in sorted(results_dir.glob("*.json")):
        result = read_result(path)
        found[result.benchmark] = result
    return found
