"""`fleet usage` and the SDK's ``usage`` (async and sync) against a gateway served by uvicorn (FLEET_AUTH=keys):
the table, the tenant a key sees, and bad flags as one ``error:`` line with no traceback."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from typer.testing import CliRunner

from fleet.cli import app as cli_app
from fleet.errors import InvalidInput
from fleet.producers.gateway import create_app
from fleet.producers.sdk import FleetClient
from fleet.producers.sdk_sync import FleetSyncClient
from fleet.settings import FleetSettings
from fleet.store.bundle import Stores
from fleet.store.usage import UsageCount, UsageKey
from tests.gateway_helpers import FAST_LIMITS, served
from tests.infra import connected_pair

TOKEN = "operator-token-for-usage-cli"


@dataclass
class Served:
    url: str
    key_a: str
    a: str
    b: str


@pytest.fixture
async def gateway() -> AsyncIterator[Served]:
    unique = uuid.uuid4().hex[:8]
    settings = FleetSettings(
        broker_url="memory://", store_url="memory://", auth="keys", operator_token=TOKEN,
        price_per_device_hour="cpu=0.36",
    )  # fmt: skip
    a, b = f"a-{unique}", f"b-{unique}"
    async with connected_pair(settings) as (broker, store):
        stores = Stores.beside(store)
        key_a = (await stores.keys.create(a, "submitter", None))[0]
        await stores.usage.add(
            {
                UsageKey(a, "embed", "1", "cpu"): UsageCount(jobs=2000, items=5000, device_seconds=100.0),
                UsageKey(b, "rerank", "3", "cpu"): UsageCount(jobs=10, items=10, device_seconds=5.0),
            }
        )
        app = create_app(settings, broker=broker, stores=stores, limits=FAST_LIMITS)
        async with served(app) as url:
            yield Served(url, key_a, a, b)


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli_app, ["usage", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


async def test_the_sdk_reads_usage_as_its_key_sees_it(gateway: Served) -> None:
    async with FleetClient(gateway.url, api_key=gateway.key_a) as fleet:
        report = await fleet.usage(["tenant", "model"], since="2h")
        assert [(r.tenant, r.model, r.jobs) for r in report.rows] == [(gateway.a, "embed", 2000)]
        assert report.rows[0].cost == pytest.approx(100 / 3600 * 0.36)
        with pytest.raises(InvalidInput, match="group_by 'nope'"):
            await fleet.usage("nope")

    def sync_read() -> list[str]:
        with FleetSyncClient(gateway.url, api_key=TOKEN) as fleet:
            return sorted(r.tenant or "" for r in fleet.usage("tenant", until=time.time()).rows)

    assert await asyncio.to_thread(sync_read) == sorted([gateway.a, gateway.b])


async def test_fleet_usage_prints_a_table_and_refuses_bad_flags_in_one_line(gateway: Served) -> None:
    code, out = await asyncio.to_thread(invoke, "--group-by", "tenant,model", "--url", gateway.url, "--api-key", TOKEN)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].split() == ["tenant", "model", "jobs", "items", "device-s", "cost", "USD", "per", "1k", "jobs"]
    assert lines[1].split() == [gateway.a, "embed", "2000", "5000", "100.000", "0.0100", "0.0050"]
    assert lines[2].split()[:3] == [gateway.b, "rerank", "10"]
    assert lines[3].split()[:2] == ["total", "2010"]
    assert "price per device-hour: cpu 0.36" in lines[4]

    code, out = await asyncio.to_thread(invoke, "--url", gateway.url, "--api-key", gateway.key_a, "-g", "tenant")
    assert code == 0 and gateway.b not in out and gateway.a in out

    for args, code_wanted, words in (
        (["--group-by", "tenant,secret"], 2, "--group-by 'tenant,secret'"),
        (["--group-by", "model,model"], 2, "at most once"),
        (["--from", "yesterday"], 1, "from 'yesterday' is not a time"),
        (["--from", "1d", "--to", "2d"], 1, "is after to"),
        (["--from", "90d"], 1, "longer than 31 days"),
    ):
        code, out = await asyncio.to_thread(invoke, *args, "--url", gateway.url, "--api-key", TOKEN)
        assert code == code_wanted, out
        assert out.startswith("error: ") and words in out and "Traceback" not in out, out
