"""Session-wide services and per-test factories.

``redis_url`` and ``nats_url`` are real servers (see ``tests/services.py``). ``broker_kind`` and ``store_kind``
parametrize a test over every implementation of a seam, so one suite runs unchanged on each.

Tests that need a server process are marked ``services`` here (``tests/fast_lane.py`` says how they are found);
``make check`` runs the others with ``FLEET_FAST_LANE=1``, under a guard that fails a test starting a server.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests import fast_lane, services
from tests.jaeger_service import Jaeger

if TYPE_CHECKING:
    from tests.kube_service import KubeCluster

pytest_plugins = ["pytester"]  # tests/test_fast_lane.py runs the fast lane's guard in a pytest run of its own


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = callspec.params if callspec is not None else {}
        if fast_lane.needs_services(getattr(item, "fixturenames", ()), params):
            item.add_marker(pytest.mark.services)


FAILED_BEFORE_TEARDOWN = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    if call.when != "teardown" and outcome.get_result().failed:  # type: ignore[attr-defined]
        item.stash[FAILED_BEFORE_TEARDOWN] = True


@pytest.fixture(autouse=True)
def _fast_lane_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """In the fast lane, fail a test that starts a server process, even when its code caught the refusal."""
    if os.environ.get(fast_lane.ENV) != "1":
        yield
        return
    refused: list[fast_lane.ServerInFastLane] = []
    with fast_lane.guard(refused):
        yield
    if refused and not request.node.stash.get(FAILED_BEFORE_TEARDOWN, False):
        pytest.fail(str(refused[0]), pytrace=False)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with services.redis_server() as url:
        yield url


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """A real 3-primary Redis Cluster (``tests/services.py``): a ``redis+cluster://`` URL naming its nodes."""
    with services.redis_cluster() as url:
        yield url


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    with services.nats_server() as url:
        yield url


@pytest.fixture
def unique() -> str:
    """A short unique token for subjects, model names and keys of one test."""
    return uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def kafka_url() -> Iterator[str]:
    """A real Apache Kafka 4.x (single KRaft node, see ``tests/kafka_service.py``) or FLEET_TEST_KAFKA_URL."""
    from tests.kafka_service import kafka_server

    with kafka_server() as url:
        yield url


@pytest.fixture(scope="session")
def jaeger() -> Iterator[Jaeger]:
    """A real Jaeger (OTLP/HTTP receiver and query API, ``tests/jaeger_service.py``) or FLEET_TEST_JAEGER_*."""
    from tests.jaeger_service import jaeger_server

    with jaeger_server() as server:
        yield server


@pytest.fixture(scope="session")
def kube() -> Iterator[KubeCluster]:
    """A real Kubernetes control plane (etcd, kube-apiserver, controller manager, scheduler, kwok with fake nodes;
    ``tests/kube_service.py``) or FLEET_TEST_KUBE_*."""
    from tests.kube_service import kube_cluster

    with kube_cluster() as cluster:
        yield cluster
