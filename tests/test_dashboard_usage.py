"""The dashboard's usage panel in a real Chromium (Debian's, driven by Playwright) against a gateway served by
uvicorn with an operator token: usage counted in the usage store shows per model and tenant with its cost and cost
per 1,000 requests, the grouping select regroups it, and the prices the gateway used are named. A screenshot lands
in ``tests/artifacts/dashboard``."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest

from fleet.producers.gateway import create_app
from fleet.settings import FleetSettings
from fleet.store.bundle import Stores
from fleet.store.usage import UsageCount, UsageKey
from tests.gateway_helpers import FAST_LIMITS, served
from tests.infra import connected_pair

TOKEN = "usage-dashboard-token"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts" / "dashboard"
BROWSER_HINT = (
    "the dashboard tests need Debian's chromium and Playwright for Python (scripts/services.sh, scripts/venv.sh)"
)


def drive(base: str, model: str, tenant: str) -> list[str]:
    """Open the page, log in, read the usage table as the operator sees it; returns what went wrong in the page."""
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        pytest.fail(f"playwright is not installed: {BROWSER_HINT}")
    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail(f"chromium is not installed: {BROWSER_HINT}")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        tab = browser.new_page(viewport={"width": 1280, "height": 900})
        tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        tab.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
        tab.set_default_timeout(15_000)
        tab.goto(f"{base}/dashboard")
        tab.get_by_label("Operator token").fill(TOKEN)
        tab.get_by_role("button", name="Log in").click()
        table = tab.locator("#usage")
        expect(table.locator("thead th")).to_have_text(
            ["model", "tenant", "jobs", "items", "device time", "cost", "per 1k requests"]
        )
        row = table.locator("tbody tr", has_text=tenant)
        expect(row.locator("th, td")).to_have_text(
            [model, tenant, "4000", "9000", "2.00 h", "4.0000 USD", "1.0000 USD"]
        )
        expect(table.locator("tbody tr.total")).to_contain_text("total")
        expect(tab.locator("#usage-note")).to_contain_text("price per device-hour: cpu 0.5, cuda 2")
        tab.locator("#usage").screenshot(path=str(ARTIFACTS / "usage.png"))
        tab.get_by_label("grouped by").select_option("model")
        expect(table.locator("thead th")).to_have_text(
            ["model", "jobs", "items", "device time", "cost", "per 1k requests"]
        )
        expect(table.locator("tbody tr", has_text=model).locator("td").nth(3)).to_have_text("4.5000 USD")
        browser.close()
    return errors


@pytest.mark.services  # Chromium
async def test_the_usage_panel_shows_cost_per_model_and_tenant() -> None:
    unique = uuid.uuid4().hex[:8]
    model, tenant, other = f"embed-{unique}", f"acme-{unique}", f"beta-{unique}"
    settings = FleetSettings(
        broker_url="memory://", store_url="memory://", operator_token=TOKEN, price_per_device_hour="cpu=0.5,cuda=2"
    )
    async with connected_pair(settings) as (broker, store):
        stores = Stores.beside(store)
        await stores.usage.add(
            {
                UsageKey(tenant, model, "1", "cuda"): UsageCount(jobs=4000, items=9000, device_seconds=7200.0),
                UsageKey(other, model, "1", "cpu"): UsageCount(jobs=10, items=10, device_seconds=3600.0),
            }
        )
        app = create_app(settings, broker=broker, stores=stores, limits=FAST_LIMITS)
        async with served(app) as base:
            errors: list[Any] = await asyncio.to_thread(drive, base, model, tenant)
    assert errors == [], errors
