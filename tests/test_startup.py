"""Start-up survives a broker that is not there yet: retries with backoff until FLEET_STARTUP_TIMEOUT_S, then one
line and a non-zero exit code (``fleet.startup``, used by every process the CLI composes)."""

from __future__ import annotations

import logging
import re
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from fleet.errors import BrokerUnavailable, ConfigError, StartupTimeout, StoreError
from fleet.startup import MAX_DELAY_S, Deadline, backoff_s, retry_until
from tests import services
from tests.processes import fleet_process, run_fleet, stop, wait_http_ready
from tests.services import free_port


class FakeTime:
    """A clock that only the fake ``sleep`` moves."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, delay_s: float) -> None:
        self.sleeps.append(delay_s)
        self.now += delay_s


def failing(errors: list[Exception], result: str = "ok"):
    calls = []

    async def attempt() -> str:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return result

    return attempt, calls


async def test_retriable_errors_are_retried_with_growing_delays_until_success(caplog) -> None:
    fake = FakeTime()
    errors: list[Exception] = [BrokerUnavailable("nats down"), StoreError("redis down"), BrokerUnavailable("again")]
    attempt, calls = failing(errors)
    caplog.set_level(logging.WARNING, logger="fleet.startup")
    result = await retry_until(Deadline.after(60, fake.clock), "connect to the broker", attempt, sleep=fake.sleep)
    assert result == "ok" and len(calls) == 4
    assert len(fake.sleeps) == 3 and fake.sleeps[0] < fake.sleeps[1] < fake.sleeps[2]
    for n, (delay, base) in enumerate(zip(fake.sleeps, (backoff_s(1), backoff_s(2), backoff_s(3)), strict=True), 1):
        assert 0.8 * base <= delay <= 1.2 * base, (n, delay)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3  # one per failed attempt
    for n, (line, error) in enumerate(zip(warnings, errors, strict=True), 1):
        assert f"could not connect to the broker (attempt {n})" in line and str(error) in line
        assert re.search(r"next attempt in \d+\.\ds", line), line


async def test_the_deadline_ends_the_retries_with_one_error_naming_the_step_and_the_cause() -> None:
    fake = FakeTime()

    async def down() -> None:
        raise BrokerUnavailable("cannot connect to NATS at nats://127.0.0.1:1")

    with pytest.raises(StartupTimeout) as caught:
        await retry_until(Deadline.after(10, fake.clock), "connect to the broker", down, sleep=fake.sleep)
    assert fake.now - 1000.0 == pytest.approx(10)  # never sleeps past the deadline
    assert max(fake.sleeps) <= MAX_DELAY_S * 1.2
    error = caught.value
    assert not error.retriable and error.attempts == len(fake.sleeps) + 1
    assert "could not connect to the broker within 10s" in error.message
    assert "nats://127.0.0.1:1" in error.message and "FLEET_STARTUP_TIMEOUT_S" in error.message
    assert "\n" not in error.message


async def test_config_errors_fail_at_once_and_a_zero_deadline_tries_once() -> None:
    fake = FakeTime()
    attempt, calls = failing([ConfigError("stream FLEET_REQ has limits retention")])
    with pytest.raises(ConfigError):
        await retry_until(Deadline.after(60, fake.clock), "connect to the broker", attempt, sleep=fake.sleep)
    assert len(calls) == 1 and fake.sleeps == []
    attempt, calls = failing([StoreError("redis down")])
    with pytest.raises(StartupTimeout):
        await retry_until(Deadline.after(0, fake.clock), "connect to the result store", attempt, sleep=fake.sleep)
    assert len(calls) == 1 and fake.sleeps == []


def test_backoff_doubles_up_to_its_cap() -> None:
    assert [backoff_s(n) for n in range(1, 8)] == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0]


# -- real processes -------------------------------------------------------------------------------------------


def start_nats(port: int, workdir: Path):
    binary = services.require_binary("nats-server", "nats-server")
    argv = [binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(workdir)]
    proc, log = services.start_server(argv, workdir)
    services.wait_port("127.0.0.1", port, proc, log, 20, "nats-server")
    return proc


def wait_for_line(log: Path, pattern: str, proc, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = re.search(pattern, log.read_text())
        if match:
            return match.group(0)
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"{pattern!r} not in the log within {timeout_s}s:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
def test_a_worker_and_a_gateway_started_before_nats_serve_once_it_comes_up(redis_url: str, tmp_path: Path) -> None:
    nats_port, metrics_port, gateway_port = free_port(), free_port(), free_port()
    nats_url = f"nats://127.0.0.1:{nats_port}"
    common = {"FLEET_BROKER_URL": nats_url, "FLEET_STORE_URL": redis_url, "FLEET_STARTUP_TIMEOUT_S": "90"}
    env = {**common, "FLEET_HEARTBEAT_INTERVAL_S": "0.5"}
    worker_log, gateway_log = tmp_path / "worker.log", tmp_path / "gateway.log"
    worker_args = ("worker", "--model", "echo", "--metrics-port", str(metrics_port))
    gateway_args = ("gateway", "--port", str(gateway_port), "--models", "echo")
    with (
        fleet_process(*worker_args, env=env, log=worker_log) as worker,
        fleet_process(*gateway_args, env=env, log=gateway_log) as gateway,
        tempfile.TemporaryDirectory(prefix="fleet-nats-late-") as tmp,
    ):
        # Both are retrying (and say so, attempt by attempt) while nothing listens on the NATS port.
        wait_for_line(worker_log, r"could not connect to the broker \(attempt 2\)", worker)
        wait_for_line(gateway_log, r"could not connect to the broker \(attempt 2\)", gateway)
        assert httpx.get(f"http://127.0.0.1:{metrics_port}/healthz", timeout=2).status_code == 200
        assert httpx.get(f"http://127.0.0.1:{metrics_port}/readyz", timeout=2).status_code == 503
        nats = start_nats(nats_port, Path(tmp))
        try:
            wait_http_ready(f"http://127.0.0.1:{metrics_port}/readyz", worker, worker_log, timeout_s=60)
            wait_http_ready(f"http://127.0.0.1:{gateway_port}/readyz", gateway, gateway_log, timeout_s=60)
            with httpx.Client(base_url=f"http://127.0.0.1:{gateway_port}", timeout=30) as http:
                job = http.post("/v1/jobs", json={"model": "echo", "input": {"late": "nats"}})
                assert job.status_code == 202, job.text
                done = http.get(f"/v1/jobs/{job.json()['job_id']}", params={"wait": 20}).json()
            assert done["state"] == "succeeded" and done["output"] == {"late": "nats"}, done
            assert stop(worker) == 0, worker_log.read_text()[-2000:]
            assert stop(gateway) == 0, gateway_log.read_text()[-2000:]
        finally:
            services.stop_server(nats)
    assert "Traceback" not in worker_log.read_text() + gateway_log.read_text()


DEADLINE_S = 8  # the first attempt pays for importing the client libraries: seconds on a loaded machine


@pytest.mark.slow
@pytest.mark.parametrize("command", ["worker", "gateway", "dispatcher"])
@pytest.mark.services
def test_the_start_up_deadline_ends_in_one_line_and_a_non_zero_exit(command: str) -> None:
    """Nothing listens on port 1: each retries until the deadline, then says so in one line. The deadline is
    measured against the same command with a zero deadline (one attempt), which pays the same imports."""
    args = {
        "worker": ("worker", "--model", "echo"),
        "gateway": ("gateway", "--models", "echo", "--port", str(free_port())),
        "dispatcher": ("dispatcher", "--model", "echo", "--port", "0"),
    }[command]
    urls = ("--broker", "nats://127.0.0.1:1", "--store", "redis://127.0.0.1:1")
    t0 = time.monotonic()
    once = run_fleet(*args, *urls, env={"FLEET_STARTUP_TIMEOUT_S": "0"})
    once_s = time.monotonic() - t0
    t0 = time.monotonic()
    result = run_fleet(*args, *urls, env={"FLEET_STARTUP_TIMEOUT_S": str(DEADLINE_S)})
    retried_s = time.monotonic() - t0
    for run in (once, result):
        out = run.stdout + run.stderr
        assert run.returncode == 1, out
        assert "Traceback" not in out
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, out
        assert "could not connect to the broker" in errors[0] and "127.0.0.1:1" in errors[0], out
    assert f"within {DEADLINE_S}s" in result.stderr and "(attempt 1)" not in once.stdout + once.stderr
    assert "(attempt 2)" in result.stdout  # it did retry, and logged each attempt (logs go to stdout)
    # Imports take seconds on a loaded machine and vary from run to run: bound only what the deadline adds.
    assert retried_s >= DEADLINE_S and retried_s - once_s <= DEADLINE_S + 8, (once_s, retried_s)
