"""The fast lane's selection and guard (``tests/fast_lane.py``): which tests need a server, which processes are
servers, and the refusal a test meets when it starts one under ``FLEET_FAST_LANE=1``."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from tests import fast_lane


@pytest.mark.parametrize(
    ("fixtures", "params", "needs"),
    [
        (["tmp_path", "unique"], {}, False),
        (["redis_url"], {}, True),
        (["env", "unique", "nats_url"], {}, True),  # a closure holding a session server
        (["aof_server"], {}, True),
        (["env"], {"env": "memory"}, False),
        (["env"], {"env": "nats+redis"}, True),  # asked for through request.getfixturevalue: seen by its kind
        (["store_kind"], {"store_kind": "redis-cluster"}, True),
        (["settings"], {"settings": "memory+redis"}, True),
        (["case"], {"case": ("kafka", 3)}, True),
        (["case"], {"case": ("redisish", 3), "n": 5}, False),
    ],
)
def test_a_test_needs_services_by_its_fixtures_or_its_backend_kind(
    fixtures: list[str], params: dict[str, Any], needs: bool
) -> None:
    assert fast_lane.needs_services(fixtures, params) is needs


@pytest.mark.parametrize(
    ("argv", "server"),
    [
        (["/usr/bin/redis-server", "--port", "0"], "redis-server"),
        (["nats-server", "-js"], "nats-server"),
        (["/usr/lib/jvm/java-17/bin/java", "-cp", "kafka.jar"], "java"),
        ([sys.executable, "-m", "fleet.cli", "gateway"], "fleet gateway"),
        ([sys.executable, "-m", "fleet", "up", "--models", "echo"], "fleet up"),
        (["/venv/bin/fleet", "worker", "--model", "echo"], "fleet worker"),
        ([sys.executable, "-m", "fleet.cli", "--help"], "fleet --help"),
        ([sys.executable, "-m", "fleet.cli", "worker", "--help"], "fleet worker"),
        ([sys.executable, "-m", "fleet.cli", "schemas", "export", "out"], "fleet schemas"),
        ([sys.executable, "-m", "uvicorn", "app:app"], "uvicorn"),
        (["/venv/lib/playwright/driver/node", "cli.js", "run-driver"], "chromium (Playwright's driver)"),
        ("redis-server --port 0", "redis-server"),
        ([sys.executable, "-c", "import fleet"], None),
        (["helm", "template", "deploy/helm"], None),
        (["git", "rev-parse", "HEAD"], None),
        ([], None),
    ],
)
def test_server_processes_are_told_from_tools(argv: list[str] | str, server: str | None) -> None:
    assert fast_lane.server_in(argv) == server


def test_the_guard_refuses_a_server_before_it_starts_and_says_how_to_mark_the_test() -> None:
    refused: list[fast_lane.ServerInFastLane] = []
    with fast_lane.guard(refused), pytest.raises(fast_lane.ServerInFastLane) as caught:
        subprocess.Popen(["redis-server", "--port", "0"])
    assert "@pytest.mark.services" in str(caught.value) and "'redis-server'" in str(caught.value)
    assert refused == [caught.value]


def test_the_guard_lets_other_processes_run_and_is_undone_on_exit() -> None:
    refused: list[fast_lane.ServerInFastLane] = []
    original = subprocess.Popen.__init__
    with fast_lane.guard(refused):
        done = subprocess.run([sys.executable, "-c", "print('ok')"], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok" and refused == []
    assert subprocess.Popen.__init__ is original


async def test_the_guard_sees_asyncio_subprocesses_too() -> None:
    import asyncio

    refused: list[fast_lane.ServerInFastLane] = []
    with fast_lane.guard(refused), pytest.raises(fast_lane.ServerInFastLane):
        await asyncio.create_subprocess_exec("nats-server", "-js")
    assert [r.program for r in refused] == ["nats-server"]


def test_a_test_that_starts_a_server_in_the_fast_lane_fails_with_the_hint(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole pytest run in the fast lane: the unmarked tests starting redis-server fail (once each), the one that
    caught the refusal too; the marked one is not collected."""
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makeconftest(
        "import os, pytest\n"
        "from tests import conftest\n"
        "_fast_lane_guard = conftest._fast_lane_guard\n"
        "pytest_collection_modifyitems = conftest.pytest_collection_modifyitems\n"
        "pytest_runtest_makereport = conftest.pytest_runtest_makereport\n"
        "def pytest_configure(config):\n"
        "    config.addinivalue_line('markers', 'services: needs a server')\n"
    )
    pytester.makepyfile(
        "import subprocess, pytest\n"
        "def test_sneaky():\n"
        "    try:\n"
        "        subprocess.Popen(['redis-server'])\n"
        "    except Exception:\n"
        "        pass\n"
        "@pytest.mark.services\n"
        "def test_marked():\n"
        "    subprocess.Popen(['redis-server'])\n"
        "def test_plain():\n"
        "    subprocess.Popen(['nats-server'])\n"
        "def test_pure():\n"
        "    assert 1 + 1 == 2\n"
    )
    monkeypatch.setenv(fast_lane.ENV, "1")
    result = pytester.runpytest_inprocess("-m", "not services", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1, failed=1, deselected=1)  # sneaky: its call passed, its teardown not
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_sneaky*",
            "this test started 'redis-server', a server or fleet process*Mark this test @pytest.mark.services*",
            "*_ test_plain _*",
            "E * this test started 'nats-server', a server or fleet process*Mark this test @pytest.mark.services*",
        ]
    )
