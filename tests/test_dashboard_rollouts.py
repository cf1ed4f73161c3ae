"""The dashboard's rollouts panel in a real Chromium (Debian's, driven by Playwright) against ``fleet up`` on NATS +
Redis, whose rollout controller ticks every 0.3 s.

The test writes traffic policies and records outcomes and agreement into Redis as the workers' settle hook does
(``RolloutStore.record_outcome`` / ``record_agreement``); the controller in ``fleet up`` acts on them and the page
shows it: each version's share, window, shadow agreement and breaker, the controller's decisions (a canary that
starts, a breaker that opens and closes, a rollback with its reason), and the promote / roll back / set weight
buttons with their confirmation, checked through the REST API and the audit log. Screenshots land in
``tests/artifacts/dashboard``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from fleet.lifecycle.breaker import BreakerConfig
from fleet.lifecycle.controller import RolloutConfig
from fleet.lifecycle.traffic import TrafficPolicy
from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.bundle import Stores
from fleet.store.rollouts import RolloutDoc, RolloutStore
from tests.infra import until
from tests.processes import fleet_process, stop, wait_http_ready
from tests.services import free_port

pytestmark = pytest.mark.slow

TOKEN = "rollouts-dashboard-token"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts" / "dashboard"
BROWSER_HINT = (
    "the dashboard tests need Debian's chromium and Playwright for Python: 'apt-get install chromium' "
    "(scripts/services.sh does it) and 'uv pip install -e .[test]' (scripts/venv.sh); no browser is downloaded"
)
T = TypeVar("T")


@dataclass
class Up:
    base: str
    api: httpx.Client
    redis_url: str

    def rollouts(self, use: Callable[[RolloutStore], Awaitable[T]]) -> T:
        """Run ``use`` on the rollouts store of the fleet's Redis (a connection of its own)."""

        async def run() -> T:
            store = make_store(FleetSettings(store_url=self.redis_url))
            await store.connect()
            try:
                return await use(Stores.beside(store).rollouts)
            finally:
                await store.close()

        # in a thread of its own: Playwright's sync API keeps an event loop running in this one
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(lambda: asyncio.run(run())).result()

    def view(self, model: str) -> dict[str, Any]:
        return dict(self.api.get(f"/v1/models/{model}/rollout").raise_for_status().json())


def expect(locator: Any) -> Any:
    from playwright.sync_api import expect as pw_expect

    return pw_expect(locator)


@pytest.fixture(scope="module")
def up(nats_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    log, port = tmp_path_factory.mktemp("rollouts") / "up.log", free_port()
    env = {"FLEET_OPERATOR_TOKEN": TOKEN, "FLEET_ROLLOUT_INTERVAL_S": "0.3", "FLEET_ROLLOUT_WINDOW_S": "60"}
    args = ("up", "--port", str(port), "--models", "echo", "--broker", nats_url, "--store", redis_url)
    with fleet_process(*args, env=env, log=log) as proc:
        base = f"http://127.0.0.1:{port}"
        wait_http_ready(f"{base}/readyz", proc, log)
        with httpx.Client(base_url=base, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as api:
            yield Up(base, api, redis_url)
        assert stop(proc) == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def page(up: Up) -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(f"playwright is not installed: {BROWSER_HINT}")
    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail(f"chromium is not installed: {BROWSER_HINT}")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        tab = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        tab.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
        tab.set_default_timeout(15_000)
        tab.goto(f"{up.base}/dashboard")
        tab.get_by_label("Operator token").fill(TOKEN)
        tab.get_by_role("button", name="Log in").click()
        expect(tab.locator("#main")).to_be_visible()
        yield tab
        browser.close()
        assert [e for e in errors if "409" not in e and "traffic" not in e] == [], errors


@pytest.fixture(scope="module")
def models(up: Up) -> Iterator[tuple[str, str]]:
    """Two models with traffic policies: one under automatic rollout (canary, shadow), one moved by hand."""
    unique = uuid.uuid4().hex[:8]
    auto, by_hand = f"canary-{unique}", f"manual-{unique}"
    config = RolloutConfig(steps=(0.05, 0.5, 1.0), min_requests=20, hold_s=3600, min_agreement=None)
    policy = TrafficPolicy(primary="1", canary="2", shadow="3", shadow_share=0.1)
    breaker = BreakerConfig(consecutive_failures=5, cool_down_s=1.0, max_cool_down_s=10.0)
    docs = [
        RolloutDoc(model=auto, policy=policy, rollout=config, breaker=breaker),
        RolloutDoc(model=by_hand, policy=TrafficPolicy(primary="1", canary="2", canary_weight=0.2), rollout=None),
    ]

    async def write(store: RolloutStore) -> None:
        for doc in docs:
            assert await store.write(doc, 0)
        for _ in range(30):
            await store.record_outcome(auto, "1", ok=True, latency_ms=12.0)
        for score in (1.0, 0.8, 0.6, 1.0, 0.6):
            await store.record_agreement(auto, "3", score)

    up.rollouts(write)
    yield auto, by_hand

    async def delete(store: RolloutStore) -> None:
        for doc in docs:
            await store.delete(doc.model)

    up.rollouts(delete)


def card(page: Any, model: str) -> Any:
    return page.locator(f'article.rollout[data-model="{model}"]')


def row(page: Any, model: str, version: str) -> Any:
    return card(page, model).locator(f'tbody tr[data-key="{version}"]')


def confirm(page: Any, ok: bool = True) -> None:
    dialog = page.locator("dialog#confirm")
    expect(dialog).to_be_visible()
    page.locator("#confirm-ok" if ok else "#confirm-cancel").click()
    expect(dialog).to_be_hidden()


def test_the_panel_shows_versions_shares_agreement_and_the_controllers_first_step(
    up: Up, page: Any, models: tuple[str, str]
) -> None:
    auto, by_hand = models
    expect(card(page, auto).locator("h3")).to_have_text(auto)
    decisions = card(page, auto).locator('[data-role="decisions"]')
    expect(decisions.locator('li[data-action="step"]')).to_contain_text("canary started: weight 0 % -> 5 %")
    expect(decisions.locator('li[data-action="hold"]')).to_contain_text("too few samples")  # once, not every tick
    expect(card(page, auto).locator('[data-role="phase"]')).to_have_text("rolling · step 1 of 3")
    cells = [row(page, auto, v).locator("td") for v in ("1", "2", "3")]
    expect(cells[0].nth(1)).to_have_text("primary")
    expect(cells[0].nth(2)).to_have_text("95 %")
    expect(cells[1].nth(2)).to_have_text("5 %")
    expect(cells[2].nth(2)).to_have_text("10 % mirrored")
    expect(cells[0].nth(3)).to_have_text("30")
    expect(cells[2].nth(6)).to_have_text("0.8 (5)")  # mean of five shadow comparisons
    expect(cells[1].nth(7)).to_have_text("closed")
    expect(card(page, by_hand).locator('[data-role="phase"]')).to_have_text("weights by hand")
    expect(row(page, by_hand, "2").locator("td").nth(2)).to_have_text("20 %")
    view = up.view(auto)
    assert view["doc"]["policy"]["canary_weight"] == 0.05
    assert [d["action"] for d in reversed(view["decisions"])][:2] == ["step", "hold"]


def test_a_failing_canary_opens_its_breaker_and_is_rolled_back_then_the_breaker_closes(
    up: Up, page: Any, models: tuple[str, str]
) -> None:
    auto, _ = models

    async def failing(store: RolloutStore) -> None:
        for i in range(30):
            await store.record_outcome(auto, "2", ok=i < 20, latency_ms=15.0)  # the last 10 fail, in a row

    up.rollouts(failing)
    decisions = card(page, auto).locator('[data-role="decisions"]')
    expect(decisions.locator('li[data-action="roll_back"]')).to_contain_text(
        "canary errors 33.33 % against primary 0 %"
    )
    expect(card(page, auto).locator('[data-role="phase"]')).to_have_text("rolled back")
    expect(row(page, auto, "2").locator("td").nth(2)).to_have_text("0 %")
    expect(decisions.locator('li[data-action="breaker"]', has_text="consecutive failures")).to_have_count(1)
    expect(decisions.locator('li[data-action="breaker"]', has_text="half-open")).to_have_count(1)
    page.screenshot(path=ARTIFACTS / "rollouts-rolled-back.png", full_page=True)

    async def probe(store: RolloutStore) -> None:
        await store.record_outcome(auto, "2", ok=True, latency_ms=15.0)

    up.rollouts(probe)  # the half-open breaker's probe succeeds
    expect(row(page, auto, "2")).to_have_attribute("data-breaker", "closed")
    expect(decisions.locator('li[data-action="breaker"]', has_text="closed: a probe succeeded")).to_have_count(1)
    breakers = [e for e in up.view(auto)["decisions"] if e["action"] == "breaker"]
    assert [e["reason"].split(":")[1].strip() for e in reversed(breakers)] == ["opened", "half-open after 1s", "closed"]


def test_promote_is_confirmed_then_done_and_named_on_the_timeline_and_in_the_audit_log(
    up: Up, page: Any, models: tuple[str, str]
) -> None:
    auto, _ = models
    until(lambda: up.view(auto)["doc"]["state"]["phase"] == "rolled_back", 15, "the rollback of the earlier test")
    promote = card(page, auto).locator('[data-control="promote"]')
    promote.click()
    confirm(page, ok=False)  # cancelled: nothing moves
    expect(page.locator("#result")).to_contain_text("not done (cancelled)")
    assert up.view(auto)["doc"]["policy"]["primary"] == "1"
    promote.click()
    expect(page.locator("#confirm-body")).to_contain_text("Version 2 (now at 0 %) becomes the primary")
    confirm(page)
    expect(page.locator("#result")).to_contain_text(f"{auto}: version 2 promoted to primary")
    view = up.view(auto)
    assert view["doc"]["policy"]["primary"] == "2" and view["doc"]["policy"]["canary"] is None
    assert view["decisions"][0]["by"] == "operator-token"
    expect(card(page, auto).locator('[data-role="decisions"] li').first).to_contain_text("promoted by operator-token")
    expect(card(page, auto).locator('[data-control="promote"]')).to_be_disabled()  # no canary left
    expect(page.locator("#audit tbody tr", has_text="rollout.promote").first).to_contain_text(auto)


def test_set_weight_sends_the_traffic_policy_with_confirmation(up: Up, page: Any, models: tuple[str, str]) -> None:
    _, by_hand = models
    sent: list[dict[str, Any]] = []

    def answer(route: Any) -> None:  # PUT /v1/models/{name}/traffic belongs to the traffic routes: recorded here
        sent.append({"method": route.request.method, "body": json.loads(route.request.post_data or "null")})
        route.fulfill(status=200, content_type="application/json", body="{}")

    page.route(f"**/v1/models/{by_hand}/traffic", answer)
    try:
        form = card(page, by_hand).locator("form")
        form.locator('input[name="weight"]').fill("30")
        form.locator('[data-control="set-weight"]').click()
        expect(page.locator("#confirm-title")).to_have_text(f"Set {by_hand}'s canary weight to 30 %")
        confirm(page)
        expect(page.locator("#result")).to_contain_text(f"{by_hand}: canary 2 at 30 %")
    finally:
        page.unroute(f"**/v1/models/{by_hand}/traffic")
    [call] = sent
    assert call["method"] == "PUT"
    policy = call["body"]["policy"]
    assert call["body"]["rollout"] is None and (policy["primary"], policy["canary"]) == ("1", "2")
    assert call["body"]["breaker"] == BreakerConfig().model_dump(mode="json")  # kept as it was
    assert policy["canary_weight"] == pytest.approx(0.3)
    assert set(policy) == set(TrafficPolicy.model_fields)  # every field of the policy, as PUT replaces it
    page.screenshot(path=ARTIFACTS / "rollouts.png", full_page=True)
