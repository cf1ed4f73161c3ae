"""Run ``fleet`` commands as real processes for tests, with readable failures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def fleet_env(**env: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    inherited = os.environ.get("PYTHONPATH")  # kept after the checkout, e.g. packages installed with --target
    out.update(PYTHONPATH=os.pathsep.join([str(ROOT), *([inherited] if inherited else [])]), PYTHONUNBUFFERED="1")
    out.update(COLUMNS="200", **env)
    return out


def fleet_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "fleet.cli", *args]


def run_fleet(*args: str, env: dict[str, str] | None = None, timeout_s: float = 60, stdin: str | None = None):
    return subprocess.run(
        fleet_argv(*args),
        env=fleet_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        input=stdin,
        cwd=ROOT,
    )


@contextmanager
def fleet_process(*args: str, env: dict[str, str] | None = None, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A background ``fleet`` process; killed at the end if still running. Its output goes to ``log``."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            fleet_argv(*args), env=fleet_env(**(env or {})), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)


def wait_http_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready within {timeout_s}s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 30) -> int:
    proc.send_signal(sig)
    return proc.wait(timeout_s)
