"""The fast lane (``make check``): the tests that need no server process, and a guard for the ones that slip in.

A test is marked ``services`` (and left to ``make test``) when

1. its fixture closure holds a fixture that starts a server (``SERVER_FIXTURES``: the session servers of
   ``tests/conftest.py`` and the fixtures that start private ones), or
2. it is parametrized over a backend kind that is a server (``memory`` is not; ``nats``, ``redis``,
   ``nats+redis``, ``redis-cluster``, ``kafka`` are): fixtures such as ``env`` or ``store_factory`` ask for
   ``redis_url`` through ``request.getfixturevalue`` only for those kinds, which the closure cannot see, or
3. it says so itself: ``@pytest.mark.services`` (or ``pytestmark``) for a test that starts a server in its body.

With ``FLEET_FAST_LANE=1`` (``make check`` sets it) every new process is checked before it starts: a server
(``SERVER_PROGRAMS``, Chromium through Playwright's driver) or any ``fleet`` command (a gateway, a worker, ``fleet
up``; ``fleet --help`` too: a whole Fleet start-up, seconds a test)
raises ``ServerInFastLane``, and the test fails with the fix in its message, even when its code caught the error.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import PurePath
from typing import Any

ENV = "FLEET_FAST_LANE"
SERVER_FIXTURES = frozenset(
    {
        # tests/conftest.py: the session's servers
        "redis_url",
        "nats_url",
        "kafka_url",
        "redis_cluster_url",
        "jaeger",
        "kube",
        # fixtures starting servers of their own
        "private_redis",  # tests/contract/test_store_contract.py
        "aof_server",  # tests/contract/test_store_contract.py
        "server",  # tests/test_nats_broker.py: a private nats-server
        "redis_aof",  # tests/test_outage_waiters.py
        "sasl_kafka",  # tests/test_secure_kafka.py
        "tls_redis",  # tests/test_secure_kafka.py, tests/test_secure_links.py
        "tls_nats",  # tests/test_secure_links.py
        "fleet_image",  # tests/test_image.py: builds and runs the container image
    }
)
SERVER_KINDS = frozenset({"nats", "redis", "kafka", "redis-cluster", "redis_cluster"})
SERVER_PROGRAMS = frozenset(
    {
        "redis-server",
        "nats-server",
        "java",
        "chromium",
        "chromium-browser",
        "chrome",
        "valgrind",
        "mvn",
        "kcat",
        "podman",
        "buildah",
    }
)
MARK_HINT = (
    "make check (FLEET_FAST_LANE=1) runs only the tests that start no server and no fleet process. Mark this test "
    "@pytest.mark.services (or request a server fixture such as redis_url), and it runs in make test."
)


class ServerInFastLane(RuntimeError):
    """A test started a server process in the fast lane."""

    def __init__(self, program: str) -> None:
        super().__init__(f"this test started {program!r}, a server or fleet process. {MARK_HINT}")
        self.program = program


def kinds_in(value: Any) -> set[str]:
    """The backend kinds a parameter names: ``"nats+redis"`` names nats and redis; tuples and lists are searched."""
    if isinstance(value, str):
        return set(value.split("+"))
    if isinstance(value, tuple | list):
        return {kind for part in value for kind in kinds_in(part)}
    return set()


def needs_services(fixturenames: Iterable[str], params: dict[str, Any]) -> bool:
    if SERVER_FIXTURES.intersection(fixturenames):
        return True
    return any(SERVER_KINDS & kinds_in(value) for value in params.values())


def server_in(argv: Sequence[str] | str) -> str | None:
    """The server ``argv`` would start, or None for any other process."""
    words = argv.split() if isinstance(argv, str) else [os.fsdecode(w) for w in argv]
    if not words:
        return None
    program = PurePath(words[0]).name
    if program in SERVER_PROGRAMS:
        return program
    if "playwright" in words[0] or (program == "node" and any("playwright" in w for w in words[1:])):
        return "chromium (Playwright's driver)"
    if program == "fleet":
        return fleet_server(words[1:])
    for i, word in enumerate(words[1:-1], start=1):
        if word == "-m" and words[i + 1] == "uvicorn":
            return "uvicorn"
        if word == "-m" and words[i + 1] in ("fleet", "fleet.cli"):
            return fleet_server(words[i + 2 :])
    return None


def fleet_server(args: Sequence[str]) -> str:
    """Every ``fleet`` process counts: a serving one (``up``, ``worker``, ``gateway``) is a server, and a short one
    (``--help``, a refusal) pays Fleet's whole start-up, seconds a test on a busy machine."""
    command = next((word for word in args if not word.startswith("-")), None)
    return f"fleet {command or ' '.join(args[:1])}".rstrip()


@contextmanager
def guard(violations: list[ServerInFastLane]) -> Iterator[None]:
    """While open, a process that is a server is refused before it starts, and the refusal kept in ``violations``."""
    original = subprocess.Popen.__init__

    def checked_init(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        program = server_in(args if isinstance(args, str) else list(args))
        if program is not None:
            refused = ServerInFastLane(program)
            violations.append(refused)
            raise refused
        original(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = checked_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen.__init__ = original  # type: ignore[method-assign]
