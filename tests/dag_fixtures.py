"""The broker/store fixtures of the DAG end-to-end suites (memory, NATS + Redis, Kafka + Redis): a suite imports
``settings_fixture, infra_fixture, fleet_fixture`` and asks for ``settings``, ``infra``, ``fleet``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from fleet.brokers.base import Broker
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from tests.dagkit import DagFleet, dag_fleet
from tests.infra import PAIRS, connected_pair, settings_for


def urls_for(request: pytest.FixtureRequest, pair: str) -> dict[str, str]:
    return {k: request.getfixturevalue(f"{k}_url") for k in pair.split("+") if k != "memory"}


@pytest.fixture(name="settings", params=PAIRS)
def settings_fixture(request: pytest.FixtureRequest) -> FleetSettings:
    return settings_for(request.param, urls_for(request, request.param))


@pytest.fixture(name="infra")
async def infra_fixture(settings: FleetSettings) -> AsyncIterator[tuple[Broker, ResultStore]]:
    async with connected_pair(settings) as pair:
        yield pair


@pytest.fixture(name="fleet")
async def fleet_fixture(
    infra: tuple[Broker, ResultStore], settings: FleetSettings, unique: str
) -> AsyncIterator[DagFleet]:
    broker, store = infra
    async with dag_fleet(broker, store, settings, unique) as running:
        yield running
