"""Every ``fleet`` command answers a bad path, an unreachable server or a bad flag with a short message that names
the problem and a non-zero exit code: never a traceback.

Unreachable servers are ports nothing listens on (1); ``FLEET_STARTUP_TIMEOUT_S=0`` makes each try once.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator

import pytest

from tests.processes import run_fleet

DOWN = ("--broker", "nats://127.0.0.1:1", "--store", "redis://127.0.0.1:1")
ONCE = {"FLEET_STARTUP_TIMEOUT_S": "0"}
MAX_LINES = 8  # a usage error: "Usage", "Try ... -h", and the message in a box

# (id, argv, what the output must mention)
CASES: list[tuple[str, tuple[str, ...], str]] = [
    # fleet (the group itself)
    ("fleet-unknown-command", ("frobnicate",), "No such command 'frobnicate'"),
    ("fleet-unknown-flag", ("--frobnicate",), "No such option: --frobnicate"),
    ("version-extra-argument", ("version", "extra"), "unexpected extra argument"),
    # up
    ("up-bad-port", ("up", "--port", "http"), "Invalid value for '--port'"),
    ("up-port-out-of-range", ("up", "--port", "70000"), "port"),
    ("up-bad-broker-scheme", ("up", "--broker", "ftp://127.0.0.1"), "'ftp'"),
    ("up-unknown-model", ("up", "--models", "echo,nope"), "unknown model 'nope'"),
    ("up-unreachable", ("up", "--models", "echo", *DOWN), "could not connect to the broker"),
    ("up-bad-log-level", ("up", "--log-level", "LOUD"), "log_level"),
    # worker
    ("worker-missing-model", ("worker",), "name the model to serve: --model NAME"),
    ("worker-model-and-models", ("worker", "--model", "echo", "--models", "echo,sleep", *DOWN), "not both"),
    ("worker-budget-one-model", ("worker", "--model", "echo", "--memory-budget", "1GiB", *DOWN), "--memory-budget"),
    (
        "worker-bad-budget",
        ("worker", "--models", "echo,sleep", "--memory-budget", "lots", *DOWN),
        "--memory-budget 'lots' is not a size",
    ),
    ("worker-model-named-twice", ("worker", "--models", "echo,sleep,echo", *DOWN), "model 'echo' is named twice"),
    ("worker-models-unknown", ("worker", "--models", "echo,nope", *DOWN), "unknown model 'nope'"),
    ("worker-unknown-pool", ("worker", "--pool", "nlp", *DOWN), "--pool 'nlp' is not a pool"),
    ("worker-models-unreachable", ("worker", "--models", "echo,sleep", *DOWN), "could not connect to the broker"),
    ("worker-unknown-model", ("worker", "--model", "nope", *DOWN), "unknown model 'nope'"),
    (
        "worker-bad-import-path",
        ("worker", "--model", "no_such_pkg.mod:Handler", *DOWN),
        "cannot import 'no_such_pkg.mod'",
    ),
    ("worker-bad-device", ("worker", "--model", "embed", "--device", "tpu", *DOWN), "device 'tpu' is not supported"),
    ("worker-bad-routing", ("worker", "--model", "echo", "--routing", "teleport", *DOWN), "--routing"),
    ("worker-bad-metrics-port", ("worker", "--model", "echo", "--metrics-port", "0", *DOWN), "--metrics-port"),
    ("worker-memory-broker", ("worker", "--model", "echo"), "needs a real broker and store"),
    ("worker-bad-max-batch", ("worker", "--model", "echo", "--max-batch", "0", *DOWN), "max_batch"),
    ("worker-unreachable-broker", ("worker", "--model", "echo", *DOWN), "could not connect to the broker"),
    ("worker-bad-replicas", ("worker", "--model", "sleep", "--replicas", "0", *DOWN), "--replicas"),
    ("worker-too-many-replicas", ("worker", "--model", "sleep", "--replicas", "65", *DOWN), "--replicas"),
    (
        "worker-replicas-of-an-inline-model",
        ("worker", "--model", "echo", "--replicas", "4", *DOWN),
        "model 'echo' computes inline on the worker's event loop, so replicas (4) cannot run it at once",
    ),
    (
        "worker-replicas-of-an-unsafe-handler",
        ("worker", "--model", "tests.handlers_for_tests:Items", "--replicas", "2", *DOWN),
        "does not declare replica_safe = True",
    ),
    # gateway
    ("gateway-unreachable", ("gateway", "--models", "echo", *DOWN), "could not connect to the broker"),
    ("gateway-memory", ("gateway",), "needs a real broker and store"),
    ("gateway-bad-store-scheme", ("gateway", "--store", "mysql://x", "--broker", "nats://127.0.0.1:1"), "'mysql'"),
    # publish
    (
        "publish-missing-file",
        ("publish", "--model", "echo", "--broker", DOWN[1], "/nonexistent.jsonl"),
        "/nonexistent.jsonl",
    ),
    ("publish-directory", ("publish", "--model", "echo", "--broker", DOWN[1], "/tmp"), "/tmp"),
    ("publish-unknown-model", ("publish", "--model", "nope", "--broker", DOWN[1], "-"), "unknown model 'nope'"),
    ("publish-memory-broker", ("publish", "--model", "echo", "-"), "publish needs a real broker"),
    ("publish-missing-argument", ("publish", "--model", "echo"), "Missing argument"),
    ("publish-bad-concurrency", ("publish", "--model", "echo", "--concurrency", "0", "-"), "--concurrency"),
    ("publish-unreachable", ("publish", "--model", "echo", "--broker", DOWN[1], "{lines}"), "127.0.0.1:1"),
    # dispatcher
    ("dispatcher-missing-model", ("dispatcher",), "Missing option '--model'"),
    ("dispatcher-bad-policy", ("dispatcher", "--model", "echo", "--policy", "luck", *DOWN), "unknown dispatch policy"),
    ("dispatcher-unreachable", ("dispatcher", "--model", "echo", "--port", "0", *DOWN), "could not connect"),
    # autoscaler
    ("autoscaler-bad-backend", ("autoscaler", "--backend", "magic", *DOWN), "'magic'"),
    ("autoscaler-bad-replicas", ("autoscaler", "--min-replicas", "5", "--max-replicas", "2", *DOWN), "replicas"),
    ("autoscaler-bad-queue-age", ("autoscaler", "--max-queue-age-s", "0", *DOWN), "max_queue_age_s"),
    ("autoscaler-unreachable", ("autoscaler", "--backend", "dry-run", "--model", "echo", *DOWN), "could not connect"),
    # sim
    ("sim-bad-loads", ("sim", "--loads", "2"), "load"),
    ("sim-unknown-policy", ("sim", "--policies", "luck"), "luck"),
    ("sim-bad-speeds", ("sim", "--speeds", "fast"), "bad speed group 'fast'"),
    # dag
    ("dag-validate-missing-file", ("dag", "validate", "/nonexistent.yaml"), "cannot read /nonexistent.yaml"),
    ("dag-validate-directory", ("dag", "validate", "/tmp"), "cannot read /tmp"),
    (
        "dag-validate-unknown-models",
        ("dag", "validate", "dags/examples/chain.yaml", "--models", "nope"),
        "unknown model 'nope'",
    ),
    ("dag-validate-malformed", ("dag", "validate", "{lines}"), "name: field required"),
    ("dag-show-unreachable", ("dag", "show", "chain", "--url", "http://127.0.0.1:1"), "cannot reach the gateway"),
    (
        "dag-run-bad-input",
        ("dag", "run", "chain", "--input", "{{nope", "--url", "http://127.0.0.1:1"),
        "--input is not valid JSON",
    ),
    ("dag-run-missing-file", ("dag", "run", "/nonexistent.yaml"), "cannot read /nonexistent.yaml"),
    ("dag-run-unreachable", ("dag", "run", "dags/examples/chain.yaml", "--url", "http://127.0.0.1:1"), "127.0.0.1:1"),
    ("dag-unknown-subcommand", ("dag", "draw"), "No such command 'draw'"),
    # keys
    ("keys-bad-role", ("keys", "create", "--tenant", "t", "--role", "root"), "role 'root'"),
    ("keys-missing-tenant", ("keys", "create", "--role", "admin"), "Missing option '--tenant'"),
    ("keys-bad-expiry", ("keys", "create", "--tenant", "t", "--role", "admin", "--expires", "soon"), "expires 'soon'"),
    ("keys-memory-store", ("keys", "list", "--store", "memory://"), "fleet up"),
    ("keys-unreachable", ("keys", "list", "--store", "redis://127.0.0.1:1/0"), "127.0.0.1:1"),
    ("usage-bad-group", ("usage", "--group-by", "tenant,password"), "--group-by 'tenant,password'"),
    ("usage-unreachable", ("usage", "--url", "http://127.0.0.1:1"), "cannot reach the gateway"),
    ("keys-revoke-missing-id", ("keys", "revoke"), "Missing argument"),
    ("keys-unknown-subcommand", ("keys", "rotate"), "No such command 'rotate'"),
    # jobs
    ("jobs-list-unreachable", ("jobs", "list", "--url", "http://127.0.0.1:1"), "cannot reach the gateway"),
    ("jobs-list-huge-limit", ("jobs", "list", "--limit", "100000"), "Invalid value for '--limit'"),
    ("jobs-list-bad-pages", ("jobs", "list", "--pages", "0"), "Invalid value for '--pages'"),
    ("jobs-submit-missing-file", ("jobs", "submit", "--file", "/nonexistent.jsonl"), "cannot read /nonexistent.jsonl"),
    ("jobs-submit-no-file", ("jobs", "submit"), "Missing option '--file'"),
    ("jobs-submit-not-json-lines", ("jobs", "submit", "--file", "/etc/hostname"), "line 1 is not valid JSON"),
    ("jobs-unknown-subcommand", ("jobs", "delete"), "No such command 'delete'"),
    # models
    (
        "models-add-missing-folder",
        ("models", "add", "/nonexistent", "--name", "m", "--repository", "{tmp}"),
        "no such folder",
    ),
    ("models-add-missing-name", ("models", "add", "/tmp"), "Missing option '--name'"),
    ("models-add-bad-name", ("models", "add", "/tmp", "--name", "../m", "--repository", "{tmp}"), "is not allowed"),
    ("models-show-unknown", ("models", "show", "nope", "--repository", "{tmp}"), "unknown model 'nope'"),
    ("models-verify-bad-version", ("models", "verify", "m@../1", "--repository", "{tmp}"), "version '../1'"),
    ("models-sign-missing-key", ("models", "sign", "m"), "Missing option '--private-key'"),
    ("models-keygen-unwritable", ("models", "keygen", "/proc/nope/key.pem"), "/proc/nope/key.pem"),
    ("models-pull-bad-id", ("models", "pull", "not an id", "--repository", "{tmp}"), "is not a Hub model id"),
    ("models-unknown-subcommand", ("models", "push"), "No such command 'push'"),
    (
        "brackets-are-not-markup",
        ("worker", "--model", "echo", "--app-dir", "/nope/a[b]c"),
        "/nope/a[b]c: no such folder",
    ),
    (
        "up-unknown-repository-version",
        ("up", "--models", "echo@3"),
        "model 'echo' is served at version '1' here, not '3'",
    ),
    # gateway on an open address without FLEET_AUTH
    (
        "gateway-open-bind-without-auth",
        ("gateway", "--host", "0.0.0.0", "--broker", "nats://127.0.0.1:1", "--store", "redis://127.0.0.1:1/0"),
        "FLEET_AUTH",
    ),
    ("gateway-bad-auth", ("gateway", "--auth", "maybe", *DOWN), "auth"),
    # schemas
    ("schemas-export-unwritable", ("schemas", "export", "/proc/nope"), "/proc/nope"),
    ("schemas-export-under-a-file", ("schemas", "export", "/dev/null/schemas"), "/dev/null/schemas"),
    ("schemas-export-unknown-model", ("schemas", "export", "{tmp}", "--models", "nope"), "unknown model 'nope'"),
    ("schemas-missing-directory", ("schemas", "export"), "Missing argument"),
    ("schemas-unknown-subcommand", ("schemas", "import"), "No such command 'import'"),
]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        yield sock.getsockname()[1]


def check(result, expected: str) -> None:
    out = (result.stdout + result.stderr).strip()
    assert result.returncode != 0, out
    assert "Traceback" not in out, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert 0 < len(lines) <= MAX_LINES, out
    assert expected.lower() in re.sub(r"\s*│\s*", " ", out).lower(), out


@pytest.mark.parametrize(("argv", "expected"), [pytest.param(a, e, id=i) for i, a, e in CASES])
@pytest.mark.services
def test_each_command_answers_bad_input_with_one_message(argv: tuple[str, ...], expected: str, tmp_path) -> None:
    lines = tmp_path / "inputs.jsonl"
    lines.write_text('{"a": 1}\n')
    argv = tuple(a.format(lines=lines, tmp=tmp_path / "out") for a in argv)
    check(run_fleet(*argv, env=ONCE, stdin='{"a": 1}\n'), expected)


@pytest.mark.services
def test_a_worker_breaker_with_bad_thresholds_is_named() -> None:
    env = {**ONCE, "FLEET_WORKER_BREAKER": '{"consecutive_failures": 0}'}
    check(run_fleet("worker", "--model", "sleep", "--breaker", *DOWN, env=env), "worker_breaker.consecutive_failures")


@pytest.mark.services
def test_a_worker_whose_metrics_port_is_taken_says_so(busy_port: int) -> None:
    result = run_fleet("worker", "--model", "echo", "--metrics-port", str(busy_port), *DOWN, env=ONCE)
    check(result, f"cannot serve metrics and probes on 0.0.0.0:{busy_port}")
    assert "another --metrics-port" in result.stderr


@pytest.mark.services
def test_an_autoscaler_whose_metrics_port_is_taken_says_so(busy_port: int) -> None:
    result = run_fleet("autoscaler", "--backend", "dry-run", "--model", "echo", "--metrics-port", str(busy_port), *DOWN)
    check(result, f"cannot serve metrics on 0.0.0.0:{busy_port}")
    assert "another --metrics-port" in result.stderr


def test_an_unreachable_store_behind_a_reachable_broker_is_named(nats_url: str) -> None:
    result = run_fleet("worker", "--model", "echo", "--broker", nats_url, "--store", "redis://127.0.0.1:1", env=ONCE)
    check(result, "could not connect to the result store")
    assert "redis://127.0.0.1:1" in result.stderr


def test_every_command_is_covered() -> None:
    """A new command must come with its bad-input cases here."""
    import typer.main

    from fleet.cli import app

    group = typer.main.get_command(app)
    commands = set(group.commands)  # type: ignore[attr-defined]
    covered = {argv[0] for _, argv, _ in CASES if argv and not argv[0].startswith("-")} - {"frobnicate"}
    assert commands == covered, commands ^ covered


@pytest.mark.parametrize(
    ("argv", "setting"),
    [
        pytest.param(("up", "--models", "echo"), "--port or FLEET_PORT", id="up-embedded"),
        pytest.param(("up", "--models", "echo", *DOWN), "--port or FLEET_PORT", id="up-real-infrastructure"),
        pytest.param(("gateway", "--models", "echo", *DOWN), "--port or FLEET_PORT", id="gateway"),
        pytest.param(("dispatcher", "--model", "echo", *DOWN), "--port (0 turns", id="dispatcher"),
    ],
)
@pytest.mark.services
def test_a_server_port_in_use_is_one_error_line_and_never_ready(argv: tuple[str, ...], setting: str) -> None:
    """A second ``fleet up`` used to log uvicorn's bind error, print "ready" (the other process answered) and end
    in a traceback with exit 3; ``fleet gateway`` exited 3 with no ``error:`` line."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = run_fleet(*argv, "--host", "127.0.0.1", "--port", str(port), env=ONCE, timeout_s=120)
    out = (result.stdout + result.stderr).strip()
    assert result.returncode != 0, out
    assert "Traceback" not in out and not re.search(r"\bready\b", out), out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and len(out.splitlines()) == 1, out
    assert f"127.0.0.1:{port}" in errors[0] and setting in errors[0], out
