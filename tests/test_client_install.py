"""The client install: the built wheel with its base dependencies only, in a fresh venv, is under 50 MB, imports
the SDK, runs ``fleet --help`` and ``fleet schemas export``, has no torch, FastAPI, FAISS, Kubernetes, NATS client
or numpy, and a server command names the extra it needs in one line (``scripts/client_size.py`` does the work)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.processes import ROOT

spec = importlib.util.spec_from_file_location("client_size", ROOT / "scripts" / "client_size.py")
assert spec is not None and spec.loader is not None
client_size = importlib.util.module_from_spec(spec)
spec.loader.exec_module(client_size)


@pytest.mark.slow
def test_the_client_installs_under_50_mb_without_server_dependencies(tmp_path: Path) -> None:
    figures = client_size.measure(tmp_path)
    print(f"client install: {figures['installed_mb']} MB, {figures['packages']} packages")
    assert client_size.problems(figures) == []
    assert 5 < figures["installed_mb"] < client_size.LIMIT_MB  # it measured something
    assert "pip install 'fleet-inference[gateway]'" in figures["gateway_answer"]


def test_the_checks_see_a_failure() -> None:
    """``problems`` is not a rubber stamp: each way the client can go wrong is reported."""
    good = {
        "installed_mb": 45.0,
        "sdk_imports": True,
        "help_works": True,
        "schemas_export_works": True,
        "heavy_installed": [],
        "gateway_answer": "error: ... pip install 'fleet-inference[gateway]'",
        "gateway_exit": 1,
        "errors": "",
    }
    assert client_size.problems(good) == []
    for bad in (
        {"installed_mb": 50.0},
        {"sdk_imports": False},
        {"help_works": False},
        {"schemas_export_works": False},
        {"heavy_installed": ["torch"]},
        {"gateway_answer": "Traceback (most recent call last):\n  ..."},
        {"gateway_exit": 0},
    ):
        assert len(client_size.problems({**good, **bad})) == 1, bad


@pytest.mark.parametrize(
    ("module", "command", "extra"),
    [
        ("fastapi", "gateway", "gateway"),
        ("prometheus_client", "worker", "worker"),
        ("torch.nn", "worker", "models"),
        ("faiss", "gateway", "cache"),
        ("kubernetes", "autoscaler", "kubernetes"),
        ("fastapi", "up", "server"),
    ],
)
def test_a_missing_module_names_the_extra_that_installs_it(module: str, command: str, extra: str) -> None:
    from fleet.cli import command_of, missing_extra

    line = missing_extra(ModuleNotFoundError(f"No module named {module!r}", name=module), command)
    assert line.endswith(f"pip install 'fleet-inference[{extra}]'") and "\n" not in line
    assert command_of([command, "--model", "x"]) == command


def test_a_module_of_no_extra_is_named_as_it_is() -> None:
    from fleet.cli import missing_extra

    line = missing_extra(ModuleNotFoundError("No module named 'mypackage'", name="mypackage"), "worker")
    assert "mypackage" in line and "pip install" not in line
