"""A pool on the dashboard in a real Chromium (Debian's, driven by Playwright): ``fleet gateway`` on NATS + Redis
with ``FLEET_POOLS``, a pool status stored as the autoscaler stores it; the page shows the pool as one card naming
its models, and no card for the pooled model."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fleet.scaling import RedisScalingStore
from fleet.schemas.scaling import PoolMember, ScalingOverrides, ScalingStatus
from tests.processes import fleet_process, stop, wait_http_ready
from tests.services import free_port

pytestmark = pytest.mark.slow

TOKEN = "pool-page-token"


@pytest.fixture
def gateway(nats_url: str, redis_url: str, tmp_path: Path, unique: str) -> Iterator[tuple[str, str]]:
    pool = f"nlp-{unique}"
    log, port = tmp_path / "gateway.log", free_port()
    env = {"FLEET_OPERATOR_TOKEN": TOKEN, "FLEET_POOLS": f"{pool}=echo", "FLEET_OPERATOR_INTERVAL_S": "0.5"}
    args = ("gateway", "--port", str(port), "--models", "echo,sleep", "--broker", nats_url, "--store", redis_url)
    with fleet_process(*args, env=env, log=log) as proc:
        base = f"http://127.0.0.1:{port}"
        wait_http_ready(f"{base}/healthz", proc, log)
        yield base, pool
        assert stop(proc) == 0, log.read_text()[-3000:]


async def store_pool_status(redis_url: str, pool: str) -> None:
    scaling = RedisScalingStore(redis_url)
    await scaling.connect()
    try:
        await scaling.put_status(
            ScalingStatus(
                model=pool,
                current_replicas=2,
                desired_replicas=2,
                lag=5,
                arrival_rate=1.0,
                min_replicas=0,
                max_replicas=4,
                paused=False,
                backend="dry-run",
                updated_at=time.time(),
                configured=ScalingOverrides(min_replicas=0, max_replicas=4, paused=False),
                pool=[PoolMember(model="echo", lag=5, arrival_rate=1.0)],
            )
        )
    finally:
        await scaling.close()


async def test_the_page_shows_a_pool_as_one_card_with_its_models(gateway: tuple[str, str], redis_url: str) -> None:
    base, pool = gateway
    await store_pool_status(redis_url, pool)
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}) as api:
        snapshot = (await api.get("/v1/operator/snapshot")).json()
    assert {m["model"] for m in snapshot["models"]} == {pool, "sleep"}
    try:
        from playwright.async_api import async_playwright, expect
    except ImportError:
        pytest.fail("playwright is not installed: 'uv pip install -e .[test]' (scripts/venv.sh)")
    executable = shutil.which("chromium")
    assert executable, "chromium is not installed: 'apt-get install chromium' (scripts/services.sh)"
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            await page.goto(f"{base}/dashboard")
            await page.get_by_label("Operator token").fill(TOKEN)
            await page.get_by_role("button", name="Log in").click()
            card = page.locator(f'article.model[data-model="{pool}"]')
            badge = card.locator('[data-badge="pool"]')
            await expect(badge).to_be_visible(timeout=15_000)
            await expect(badge).to_have_text("pool of echo")
            await expect(card.locator('[data-stat="replicas"]')).to_have_text("2")
            await expect(page.locator('article.model[data-model="sleep"] [data-badge="pool"]')).to_be_hidden()
            assert await page.locator('article.model[data-model="echo"]').count() == 0
            assert not errors, errors
        finally:
            await browser.close()
