"""The operator dashboard in a real Chromium (Debian's, driven by Playwright) against ``fleet up`` on NATS + Redis.

One ``fleet up`` (models ``sleep``, the test handler ``gate`` and ``echo`` behind a JIQ dispatcher, with
``FLEET_OPERATOR_TOKEN`` set) and one browser serve the whole module; the page logs in through its own form. Each
test drives the page as an operator would (buttons, the confirmation dialog) and checks the effect through the REST
API, not through the page alone.
Screenshots land in ``tests/artifacts/dashboard`` (git-ignored); ``docs/dashboard.png`` is a copy of
``glance.png``, taken at 1280 px under load by ``test_the_page_reads_at_a_glance_at_1280_px``.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway_helpers import private_server
from tests.infra import until
from tests.processes import fleet_process, stop, wait_http_ready
from tests.services import free_port

pytestmark = pytest.mark.slow

TOKEN = "dashboard-test-token"
DASH = "\u2013"  # what the page shows for "no value"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts" / "dashboard"
GATE = "tests.handlers_for_tests:Gate"
BROWSER_HINT = (
    "the dashboard tests need Debian's chromium and Playwright for Python: 'apt-get install chromium' "
    "(scripts/services.sh does it) and 'uv pip install -e .[test]' (scripts/venv.sh); no browser is downloaded"
)


@dataclass
class Up:
    base: str
    api: httpx.Client
    gates: Path
    log: Path


@dataclass
class Browser:
    browser: Any
    page: Any
    requests: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def up(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    # A Redis of this module's own: the page shows what is in it (the audit log, every model's rollout), and the
    # shared one holds what the other test modules of this process left there, which the glance test would measure.
    with private_server("redis") as (redis_url, _):
        yield from _up(nats_url, redis_url, tmp_path_factory)


def _up(nats_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("dashboard")
    gates, log, port = tmp / "gates", tmp / "up.log", free_port()
    gates.mkdir()
    env = {
        "FLEET_OPERATOR_TOKEN": TOKEN,
        "FLEET_TEST_GATE_DIR": str(gates),
        "FLEET_AUTOSCALE_INTERVAL_S": "0.5",
        "FLEET_AUTOSCALE_MAX_REPLICAS": "3",
        "FLEET_AUTOSCALE_STABILIZATION_S": "3",
        "FLEET_AUTOSCALE_TARGET_DRAIN_S": "3",
        "FLEET_HEARTBEAT_INTERVAL_S": "0.5",
        "FLEET_ROUTING": "echo=dispatch",  # fleet up runs a JIQ dispatcher for echo: the dispatchers panel has one
    }
    args = ("up", "--port", str(port), "--models", f"sleep,{GATE},echo", "--broker", nats_url, "--store", redis_url)
    with fleet_process(*args, env=env, log=log) as proc:
        base = f"http://127.0.0.1:{port}"
        wait_http_ready(f"{base}/readyz", proc, log)
        assert f"operator dashboard at {base}/dashboard" in log.read_text(), "fleet up prints the dashboard URL"
        with httpx.Client(base_url=base, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as api:
            yield Up(base, api, gates, log)
        assert stop(proc) == 0, log.read_text()[-3000:]


def launch(playwright: Any) -> Any:
    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail(f"chromium is not installed: {BROWSER_HINT}")
    return playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])


def new_page(browser: Any, base: str, requests: list[str], errors: list[str]) -> Any:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.on("request", lambda r: requests.append(r.url))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
    page.set_default_timeout(15_000)
    return page


@pytest.fixture(scope="module")
def browser(up: Up) -> Iterator[Browser]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(f"playwright is not installed: {BROWSER_HINT}")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        chromium = launch(playwright)
        session = Browser(chromium, None)
        session.page = new_page(chromium, up.base, session.requests, session.errors)
        yield session
        chromium.close()


def expect(locator: Any) -> Any:
    from playwright.sync_api import expect as pw_expect

    return pw_expect(locator)


def confirm(page: Any) -> None:
    """Accept the page's confirmation dialog (an in-page <dialog>, not window.confirm)."""
    dialog = page.locator("dialog#confirm")
    expect(dialog).to_be_visible()
    page.locator("#confirm-ok").click()
    expect(dialog).to_be_hidden()


def scaling(up: Up, model: str = "sleep") -> dict[str, Any]:
    [status] = [s for s in up.api.get("/v1/scaling").raise_for_status().json() if s["model"] == model]
    return dict(status)


def panel(up: Up, model: str = "sleep") -> dict[str, Any]:
    snapshot = up.api.get("/v1/operator/snapshot").raise_for_status().json()
    [found] = [m for m in snapshot["models"] if m["model"] == model]
    return dict(found)


def card(page: Any, model: str = "sleep") -> Any:
    return page.locator(f'article.model[data-model="{model}"]')


def open_card(page: Any, model: str = "sleep") -> Any:
    """Open a model's card (collapsed by default) for its charts, decisions and controls; it stays open."""
    found = card(page, model)
    if not found.locator("details").evaluate("d => d.open"):
        found.locator("summary").click()
    expect(found.locator('[data-action="pause"]')).to_be_visible()
    return found


def summary(page: Any, key: str) -> str:
    return str(page.locator(f'#summary [data-summary="{key}"] dd').inner_text())


def test_page_loads_logs_in_and_lists_models_and_workers(up: Up, browser: Browser) -> None:
    page = browser.page
    page.goto(f"{up.base}/dashboard")
    expect(page.locator("#login")).to_be_visible()  # the token is set: the page asks for it first
    page.get_by_label("Operator token").fill(TOKEN)
    page.get_by_role("button", name="Log in").click()
    expect(page.locator("#main")).to_be_visible()
    expect(page.locator("#live")).to_contain_text("live")
    behind = until(lambda: page.evaluate("window.fleetDashboard.events") >= 3 and behind_s(page), 10, "updates")
    assert behind < 2, f"the page is {behind:.2f}s behind the gateway's latest sample"
    for model in ("sleep", "gate", "echo"):
        expect(card(page, model).locator("h3").first).to_have_text(model)
    workers = up.api.get("/v1/operator/snapshot").json()["workers"]
    assert {w["model"] for w in workers} >= {"sleep", "gate", "echo"}, workers
    rows = page.locator("#workers tbody tr")
    until(lambda: rows.count() >= 2, 10, "the workers table lists the workers")
    shown = {rows.nth(i).locator("td").nth(1).inner_text() for i in range(rows.count())}
    assert shown >= {"sleep", "gate"}
    expect(page.locator('#workers tbody tr[data-state="serving"]').first).to_be_visible()
    # each worker's loaded versions, from its heartbeats: a worker of one model loads it at its start
    echo_row = page.locator('#workers tbody tr[data-state="serving"]', has_text="echo").first
    expect(echo_row.locator('td[data-role="loaded"]')).to_have_text("v1")
    expect(echo_row.locator('td[data-role="replicas"]')).to_have_text("1")
    expect(echo_row.locator('td[data-role="breaker"]')).to_have_text("closed")  # its heartbeat's breaker
    expect(echo_row).to_have_attribute("data-breaker", "closed")
    ready = [w for w in up.api.get("/v1/operator/snapshot").json()["workers"] if w["state"] == "ready"]
    assert ready and all(w["loaded"] == ["1"] for w in ready), ready
    # no GPU on this machine: the heartbeats carry none, and the page shows no GPU column (not an empty one)
    assert all(w["gpus"] == [] and w["model_memory_bytes"] == {} for w in ready), ready
    expect(page.locator('#workers th[data-role="gpus"]')).to_be_hidden()
    expect(echo_row.locator('td[data-role="gpus"]')).to_be_hidden()
    assert page.evaluate("sessionStorage.getItem('fleet.operatorToken')") == TOKEN
    # the cards start collapsed: the head line and the reason, no controls until opened
    expect(card(page, "echo").locator('[data-action="pause"]')).to_be_hidden()
    expect(card(page, "echo").locator('[data-role="reason"]')).not_to_be_empty()
    open_card(page)  # the sleep card stays open for the controls' tests
    page.screenshot(path=ARTIFACTS / "loaded.png", full_page=True)
    assert_clean(up, browser)


def test_the_summary_row_adds_up_the_fleet(up: Up, browser: Browser) -> None:
    page = browser.page
    expect(page.locator('#summary [data-summary="models"] dd')).to_have_text("3")

    def agrees() -> bool:
        snap = up.api.get("/v1/operator/snapshot").json()
        ready = sum(w["state"] == "ready" for w in snap["workers"])
        return summary(page, "workers").startswith(f"{ready} ready · ")

    until(agrees, 10, "the summary counts the ready workers of the snapshot")
    assert re.fullmatch(r"\d+", summary(page, "waiting")), summary(page, "waiting")
    assert re.fullmatch(r"[\d.k]+/s", summary(page, "throughput")), summary(page, "throughput")
    assert re.fullmatch(r"[\d.k]+/s · \d+ dead letters?", summary(page, "errors")), summary(page, "errors")
    # an idle worker shows no latency, in the table as on its card (not "0 ms")
    idle = page.locator('#workers tbody tr[data-state="serving"]', has_text="echo").first
    expect(idle.locator("td").nth(7)).to_have_text(f"{DASH} (no job yet)")
    expect(card(page, "echo").locator('[data-stat="p99"]')).to_have_text(DASH)


def behind_s(page: Any) -> float:
    """How old the page's latest snapshot is, by the gateway's clock (same machine), when it has just arrived."""
    page.wait_for_function("() => Date.now() - window.fleetDashboard.lastEventAt < 100")
    return float(page.evaluate("Date.now() / 1000 - window.fleetDashboard.snapshot.at"))


def assert_clean(up: Up, browser: Browser) -> None:
    assert browser.errors == [], f"console errors: {browser.errors}"
    foreign = [url for url in browser.requests if not url.startswith(f"{up.base}/") and not url.startswith("data:")]
    assert foreign == [], f"requests to another host: {foreign}"


def test_the_dispatchers_panel_shows_the_echo_dispatcher(up: Up, browser: Browser) -> None:
    page = browser.page
    [view] = until(lambda: up.api.get("/v1/operator/snapshot").json()["dispatchers"], 10, "a dispatcher beat")
    row = page.locator(f'#dispatchers tbody tr[data-key="{view["dispatcher_id"]}"]')
    expect(row).to_be_visible()
    cells = row.locator("td")
    expect(cells.nth(1)).to_have_text("echo")
    expect(cells.nth(2)).to_have_text(view["policy"])
    assert view["policy"].startswith("jiq"), view
    # the echo worker is idle, so it waits in the dispatcher's idle queue
    until(lambda: int(cells.nth(3).inner_text()) >= 1, 10, "the idle worker in the idle queue")
    expect(page.locator("#dispatchers-empty")).to_be_hidden()


def test_a_burst_shows_on_the_lag_chart_and_the_replicas_rise_within_10s(up: Up, browser: Browser) -> None:
    page = browser.page
    until(lambda: scaling(up)["current_replicas"] == 1, 30, "one sleep worker before the burst")
    body = {"model": "sleep", "input": {"mean_ms": 100}}
    with ThreadPoolExecutor(16) as pool:  # a burst arrives at once
        ids = list(pool.map(lambda _: up.api.post("/v1/jobs", json=body).json()["job_id"], range(150)))
    burst_at = time.monotonic()
    replicas = card(page).locator('[data-stat="replicas"]')
    until(lambda: int(replicas.inner_text()) >= 2, 10, "the page shows the replica count rising", 0.1)
    rise_s = time.monotonic() - burst_at
    # the new replicas are listed while they start (no heartbeat yet, or warming up), and the rows add up
    starting_shown = """() => {
      const rows = [...document.querySelectorAll('#workers tbody tr')].filter((r) =>
        r.children[1].textContent === 'sleep' && ['launching', 'warming'].includes(r.dataset.state));
      const onCard = document.querySelector('article[data-model="sleep"] [data-stat="workers"]').textContent;
      const onSummary = document.querySelector('#summary [data-summary="workers"] dd').textContent;
      return rows.length > 0 && onCard.includes(`${rows.length} starting`) && !onSummary.includes(' 0 starting');
    }"""
    until(
        lambda: page.evaluate(starting_shown),
        10,
        "the starting workers listed, counted on the card and the summary",
        0.1,
    )
    rows_and_replicas = """() => {
      const rows = [...document.querySelectorAll('#workers tbody tr')].filter((r) =>
        r.children[1].textContent === 'sleep' && r.dataset.state !== 'draining');
      const shown = document.querySelector('article[data-model="sleep"] [data-stat="replicas"]').textContent;
      return [rows.length, Number(shown)];
    }"""
    until(lambda: (n := page.evaluate(rows_and_replicas))[0] == n[1] and n, 10, "workers rows == replicas")
    # the reason behind the desired replicas, in words
    expect(card(page).locator('[data-role="reason"]')).to_have_text(re.compile(r"^\d+ waiting, .*wanted"))
    lag = until(lambda: max(v or 0 for v in lag_series(page)), 10, "the lag chart shows the queued burst")
    assert lag >= 10, f"the lag chart peaked at {lag}"
    page.screenshot(path=ARTIFACTS / "burst.png", full_page=True)
    until(lambda: all(up.api.get(f"/v1/jobs/{j}").json()["state"] == "succeeded" for j in ids[-5:]), 90, "burst")
    assert rise_s <= 10


def lag_series(page: Any) -> list[float | None]:
    data = page.evaluate("window.fleetDashboard.charts.sleep.data('lag')")
    return list(data[1]) if data else []


def test_pause_and_resume_change_the_autoscaler_state(up: Up, browser: Browser) -> None:
    page = browser.page
    open_card(page)
    button = card(page).locator('[data-action="pause"]')
    expect(button).to_have_text("Pause autoscaling")
    button.click()
    confirm(page)
    until(lambda: scaling(up)["paused"] is True, 5, "paused through the API")
    expect(card(page).locator('[data-badge="paused"]')).to_be_visible()
    expect(page.locator("#result")).to_contain_text("sleep: autoscaling paused")
    expect(button).to_have_text("Resume autoscaling", timeout=5000)
    button.click()
    confirm(page)
    until(lambda: scaling(up)["paused"] is False, 5, "resumed through the API")
    expect(card(page).locator('[data-badge="paused"]')).to_be_hidden()
    # the audit panel shows both actions, by the operator token (FLEET_AUTH is off in this fleet up)
    audit = page.locator("#audit tbody")
    expect(audit.locator("tr", has_text='"paused":false').first).to_contain_text("scaling.update")
    expect(audit.locator("tr", has_text='"paused":true').first).to_contain_text("operator-token")


def test_dismissing_the_dialog_changes_nothing(up: Up, browser: Browser) -> None:
    page = browser.page
    card(page).locator('[data-action="pause"]').click()
    expect(page.locator("dialog#confirm")).to_be_visible()
    page.keyboard.press("Escape")
    expect(page.locator("dialog#confirm")).to_be_hidden()
    expect(page.locator("#result")).to_contain_text("not done")
    time.sleep(1)
    assert scaling(up)["paused"] is False


def test_min_and_max_replicas_change_the_autoscaler_state(up: Up, browser: Browser) -> None:
    page = browser.page
    sleep = open_card(page)
    sleep.get_by_label("min", exact=True).fill("1")
    sleep.get_by_label("max", exact=True).fill("4")
    sleep.get_by_role("button", name="Set bounds").click()
    confirm(page)
    until(lambda: (scaling(up)["min_replicas"], scaling(up)["max_replicas"]) == (1, 4), 5, "bounds through the API")
    expect(sleep.locator('[data-stat="bounds"]')).to_have_text("1 to 4")
    before = len(browser.errors)
    sleep.get_by_label("max", exact=True).fill("3")
    sleep.get_by_label("min", exact=True).fill("5")
    sleep.get_by_role("button", name="Set bounds").click()
    confirm(page)
    # min above max: the page shows the API's own error message, and nothing changed
    expect(page.locator("#result")).to_contain_text("Set the bounds of sleep failed: 422")
    assert (scaling(up)["min_replicas"], scaling(up)["max_replicas"]) == (1, 4)
    until(lambda: len(browser.errors) > before, 2, "Chromium logs the refused request")
    refused = browser.errors[before:]
    assert all("status of 422" in e for e in refused), refused
    del browser.errors[before:]  # expected: the one refused request
    sleep.get_by_label("min", exact=True).fill("1")  # what the card shows again (later screenshots include it)
    sleep.get_by_label("max", exact=True).fill("4")


def test_scale_to_n_holds_the_replicas_until_the_override_ends(up: Up, browser: Browser) -> None:
    page = browser.page
    sleep = open_card(page)
    sleep.get_by_label("scale to").fill("3")
    sleep.get_by_label("for (s)").fill("120")
    sleep.get_by_role("button", name="Scale now").click()
    confirm(page)
    pinned = until(lambda: panel(up)["pinned"], 5, "the override through the API")
    assert pinned["replicas"] == 3 and pinned["until"] > time.time() + 60, pinned
    until(lambda: scaling(up)["current_replicas"] == 3, 30, "the autoscaler holds 3 replicas")
    expect(sleep.locator('[data-badge="pinned"]')).to_contain_text("held at 3")
    expect(sleep.locator('[data-role="reason"]')).to_contain_text("held at 3 by an operator until")
    sleep.get_by_role("button", name="End override").click()
    confirm(page)
    until(lambda: panel(up)["pinned"] is None, 5, "the override removed")
    expect(sleep.locator('[data-badge="pinned"]')).to_be_hidden()


def test_a_redriven_dead_letter_runs_its_job_again_and_it_succeeds(up: Up, browser: Browser) -> None:
    page = browser.page
    key = f"gate-{uuid.uuid4().hex[:8]}"
    job_id = up.api.post("/v1/jobs", json={"model": "gate", "input": {"key": key}}).raise_for_status().json()["job_id"]
    until(lambda: up.api.get(f"/v1/jobs/{job_id}").json()["state"] == "failed", 20, "the closed gate fails the job")
    letter = page.locator(f'#dead-letters li[data-job="{job_id}"]')
    expect(letter).to_be_visible()
    expect(letter).to_contain_text(f"gate {key} is closed")
    (up.gates / key).touch()  # the cause is fixed: the next run succeeds
    letter.get_by_role("checkbox").check()
    expect(page.locator("#dead-selected")).to_have_text("1 selected")
    page.get_by_role("button", name="Redrive selected").click()
    confirm(page)
    expect(page.locator("#result")).to_contain_text("redriven: 1")
    try:
        until(lambda: up.api.get(f"/v1/jobs/{job_id}").json()["state"] == "succeeded", 20, "the redriven job succeeds")
    except AssertionError as exc:
        record = up.api.get(f"/v1/jobs/{job_id}").json()
        raise AssertionError(f"{exc}: {record}\n{up.log.read_text()[-4000:]}") from None
    assert up.api.get(f"/v1/jobs/{job_id}").json()["output"] == {"key": key}
    expect(letter).to_be_hidden()


def test_purging_a_dead_letter_removes_it(up: Up, browser: Browser) -> None:
    page = browser.page
    key = f"gate-{uuid.uuid4().hex[:8]}"
    job_id = up.api.post("/v1/jobs", json={"model": "gate", "input": {"key": key}}).raise_for_status().json()["job_id"]
    letter = page.locator(f'#dead-letters li[data-job="{job_id}"]')
    expect(letter).to_be_visible(timeout=20_000)
    letter.get_by_role("checkbox").check()
    page.get_by_role("button", name="Purge selected").click()
    confirm(page)
    expect(page.locator("#result")).to_contain_text("purged: 1")
    expect(letter).to_be_hidden()
    letters = up.api.get("/v1/deadletters", params={"model": "gate"}).json()["models"].get("gate", {"latest": []})
    assert job_id not in {d["job_id"] for d in letters["latest"]}
    assert up.api.get(f"/v1/jobs/{job_id}").json()["state"] == "failed", "its job stays failed"


DAG = {
    "steps": [
        {"id": "first", "model": "sleep", "input": {"mean_ms": 20}},
        {"id": "check", "model": "gate", "input": {"key": "never-open"}, "after": ["first"]},
        {"id": "last", "model": "sleep", "input": {"mean_ms": 20}, "after": ["check"]},
    ],
    "output": "${steps.first.output}",
}


def test_a_dag_runs_graph_shows_each_steps_state(up: Up, browser: Browser) -> None:
    page = browser.page
    name = f"dash{uuid.uuid4().hex[:6]}"
    up.api.post("/v1/dags", json={"name": name, **DAG}).raise_for_status()
    run_id = up.api.post(f"/v1/dags/{name}/runs", json={"input": {}}).raise_for_status().json()["run_id"]
    run = until(lambda: (r := up.api.get(f"/v1/runs/{run_id}").json())["finished_at"] and r, 30, "the run ends")
    page.locator(f'#runs tbody tr[data-key="{run_id}"] button.link').click()
    detail = page.locator(f'#run-detail[data-run-id="{run_id}"]')
    expect(detail).to_be_visible()
    expect(detail.locator("#run-state")).to_have_text(run["state"])
    graph = detail.locator(".run-graph svg")
    expect(graph).to_be_visible()
    for step, view in run["steps"].items():
        expect(detail.locator(f'.steps li[data-step="{step}"]')).to_have_attribute("data-state", view["state"])
        expect(graph).to_contain_text(f"{step} (")
        expect(graph.locator(f"g.node.{view['state']}", has_text=step)).to_have_count(1)
    assert {s["state"] for s in run["steps"].values()} >= {"succeeded", "failed"}, run["steps"]
    page.screenshot(path=ARTIFACTS / "dag.png", full_page=True)


def test_a_live_run_is_redrawn_as_its_steps_change(up: Up, browser: Browser) -> None:
    page = browser.page
    name = f"live{uuid.uuid4().hex[:6]}"
    spec = {"steps": [{"id": "slow", "model": "sleep", "input": {"mean_ms": 2500}}], "output": "${steps.slow.output}"}
    up.api.post("/v1/dags", json={"name": name, **spec}).raise_for_status()
    run_id = up.api.post(f"/v1/dags/{name}/runs", json={"input": {}}).raise_for_status().json()["run_id"]
    page.locator(f'#runs tbody tr[data-key="{run_id}"] button.link').click(timeout=5000)
    step = page.locator(f'#run-detail[data-run-id="{run_id}"] .steps li[data-step="slow"]')
    expect(step).not_to_have_attribute("data-state", "succeeded", timeout=2000)
    expect(step).to_have_attribute("data-state", "succeeded", timeout=20_000)
    expect(page.locator("#run-detail #run-state")).to_have_text("succeeded")
    # the runs table (from the live snapshot) agrees, and offers no cancel for a finished run
    row = page.locator(f'#runs tbody tr[data-key="{run_id}"]')
    expect(row.locator("td").nth(2)).to_have_text("succeeded")
    expect(row.get_by_role("button", name="Cancel")).to_be_hidden()


def test_cancel_a_run_from_its_row_and_a_job_by_its_id(up: Up, browser: Browser) -> None:
    page = browser.page
    name = f"cancel{uuid.uuid4().hex[:6]}"
    spec = {"steps": [{"id": "long", "model": "sleep", "input": {"mean_ms": 8000}}], "output": "${steps.long.output}"}
    up.api.post("/v1/dags", json={"name": name, **spec}).raise_for_status()
    run_id = up.api.post(f"/v1/dags/{name}/runs", json={"input": {}}).raise_for_status().json()["run_id"]
    row = page.locator(f'#runs tbody tr[data-key="{run_id}"]')
    row.get_by_role("button", name="Cancel").click()
    confirm(page)
    until(lambda: up.api.get(f"/v1/runs/{run_id}").json()["state"] == "cancelled", 10, "the run cancelled")
    expect(row.locator("td").nth(2)).to_have_text("cancelled")

    job_id = up.api.post("/v1/jobs", json={"model": "sleep", "input": {"mean_ms": 8000}}).json()["job_id"]
    page.get_by_label("Job id").fill(job_id)
    page.get_by_role("button", name="Cancel job").click()
    confirm(page)
    expect(page.locator("#result")).to_have_text(f"job {job_id}: cancelled")
    assert up.api.get(f"/v1/jobs/{job_id}").json()["state"] == "cancelled"


def test_a_job_is_found_by_its_id_and_the_recent_jobs_list_it(up: Up, browser: Browser) -> None:
    page = browser.page
    body = {"model": "sleep", "input": {"mean_ms": 30}}
    job_id = up.api.post("/v1/jobs", json=body).raise_for_status().json()["job_id"]
    until(lambda: up.api.get(f"/v1/jobs/{job_id}").json()["state"] == "succeeded", 30, "the job succeeds")
    record = up.api.get(f"/v1/jobs/{job_id}").json()
    page.get_by_label("Find job").fill(job_id)
    page.get_by_role("button", name="Look up", exact=True).click()
    detail = page.locator(f'#job-detail[data-job-id="{job_id}"]')
    expect(detail.locator('[data-role="state"]')).to_have_text("succeeded")
    expect(detail.locator('[data-role="model"]')).to_have_text("sleep")
    expect(detail.locator('[data-role="tenant"]')).to_have_text(record["tenant"] or "default")
    assert json.loads(detail.locator('[data-role="output"]').inner_text()) == record["output"]
    # a failed job shows its error; an unknown id says so
    key = f"gate-{uuid.uuid4().hex[:8]}"
    failed = up.api.post("/v1/jobs", json={"model": "gate", "input": {"key": key}}).json()["job_id"]
    until(lambda: up.api.get(f"/v1/jobs/{failed}").json()["state"] == "failed", 20, "the closed gate fails the job")
    page.get_by_label("Find job").fill(failed)
    page.get_by_role("button", name="Look up", exact=True).click()
    expect(page.locator(f'#job-detail[data-job-id="{failed}"] [data-role="error"]')).to_contain_text(
        f"gate {key} is closed"
    )
    before = len(browser.errors)
    page.get_by_label("Find job").fill("no-such-job")
    page.get_by_role("button", name="Look up", exact=True).click()
    expect(page.locator('#job-detail [data-role="lookup-error"]')).to_contain_text("No job no-such-job")
    until(lambda: len(browser.errors) > before, 2, "Chromium logs the 404")
    assert all("status of 404" in e for e in browser.errors[before:]), browser.errors[before:]
    del browser.errors[before:]  # expected: the one unknown id
    # the recent jobs: the newest first, each with its state now; a row opens the lookup
    row = page.locator(f'#recent-jobs tbody tr[data-key="{job_id}"]')
    expect(row).to_have_attribute("data-state", "succeeded")
    expect(page.locator(f'#recent-jobs tbody tr[data-key="{failed}"]')).to_have_attribute("data-state", "failed")
    assert page.locator("#recent-jobs tbody tr").first.get_attribute("data-key") == failed
    row.get_by_role("button").click()
    expect(page.locator(f'#job-detail[data-job-id="{job_id}"] [data-role="state"]')).to_have_text("succeeded")


def test_the_job_history_filters_by_model_and_state_and_pages(up: Up, browser: Browser) -> None:
    page = browser.page
    items = [{"model": "echo", "input": {"history": i}} for i in range(30)]
    answer = up.api.post("/v1/jobs:batch", json=items).raise_for_status().json()
    ids = {item["job_id"] for item in answer["items"]}

    def all_succeeded() -> bool:
        return all(up.api.get(f"/v1/jobs/{j}").json()["state"] == "succeeded" for j in ids)

    until(all_succeeded, 30, "the batch runs")
    newest = up.api.get("/v1/jobs", params={"model": "echo", "limit": 1}).json()["jobs"][0]["job_id"]
    rows, model, states = (
        page.locator("#recent-jobs tbody tr"),
        page.locator("#history-model"),
        page.locator("#history-state"),
    )
    model.fill("echo")
    states.select_option("succeeded")
    page.get_by_role("button", name="Filter", exact=True).click()
    until(lambda: rows.first.get_attribute("data-key") == newest, 15, "the newest echo job heads the history")
    first = {rows.nth(i).get_attribute("data-key") for i in range(rows.count())}
    assert len(first) == 25 and first <= ids  # the batch's 30 are the newest echo jobs
    assert all(rows.nth(i).get_attribute("data-state") == "succeeded" for i in range(25))
    page.get_by_role("button", name="Older", exact=True).click()
    until(lambda: rows.first.get_attribute("data-key") not in first, 15, "the older page")
    older = {rows.nth(i).get_attribute("data-key") for i in range(rows.count())}
    assert not older & first and ids <= older | first
    page.get_by_role("button", name="Newest", exact=True).click()
    until(lambda: rows.first.get_attribute("data-key") == newest, 15, "back to the newest page")
    states.select_option("failed")
    page.get_by_role("button", name="Filter", exact=True).click()
    expect(page.locator("#recent-empty")).to_have_text("No jobs match.")  # echo never fails
    model.fill("")
    states.select_option("")
    page.get_by_role("button", name="Filter", exact=True).click()


def test_draining_a_worker_retires_it_and_the_autoscaler_replaces_it(up: Up, browser: Browser) -> None:
    page = browser.page
    workers = up.api.get("/v1/operator/snapshot").json()["workers"]
    [victim, *_] = [w["worker_id"] for w in workers if w["model"] == "gate" and w["state"] == "ready"]
    row = page.locator(f'#workers tbody tr[data-key="{victim}"]')
    row.get_by_role("button", name=f"Drain worker {victim}").click()
    confirm(page)
    expect(page.locator("#result")).to_have_text(f"{victim}: draining")

    def retired() -> bool:
        beats = {w["worker_id"]: w["state"] for w in up.api.get("/v1/operator/snapshot").json()["workers"]}
        return beats.get(victim, "draining") == "draining"

    until(retired, 10, "the worker drains (or is gone)")
    expect(row).to_be_hidden(timeout=30_000)  # it exited: its heartbeats stopped

    def replaced() -> list[dict[str, Any]]:
        workers = up.api.get("/v1/operator/snapshot").json()["workers"]
        return [w for w in workers if w["model"] == "gate" and w["worker_id"] != victim and w["state"] == "ready"]

    try:
        [fresh] = until(replaced, 30, "min_replicas 1: the autoscaler starts another gate worker")
    except AssertionError as exc:
        workers = up.api.get("/v1/operator/snapshot").json()["workers"]
        raise AssertionError(f"{exc}; the snapshot's workers: {workers}\n{up.log.read_text()[-3000:]}") from None
    expect(page.locator(f'#workers tbody tr[data-key="{fresh["worker_id"]}"]')).to_have_attribute(
        "data-state", "serving"
    )
    key = f"gate-{uuid.uuid4().hex[:8]}"
    (up.gates / key).touch()
    job_id = up.api.post("/v1/jobs", json={"model": "gate", "input": {"key": key}}).json()["job_id"]
    until(lambda: up.api.get(f"/v1/jobs/{job_id}").json()["state"] == "succeeded", 30, "gate serves again")


def test_without_the_token_the_controls_answer_401_and_the_page_asks_to_log_in(up: Up, browser: Browser) -> None:
    requests: list[str] = []
    errors: list[str] = []
    page = new_page(browser.browser, up.base, requests, errors)  # a new context: no token in its session
    try:
        page.goto(f"{up.base}/dashboard")
        expect(page.locator("#login")).to_be_visible()
        expect(page.locator("#main")).to_be_hidden()
        controls = [
            ("PUT", "/v1/scaling/sleep", {"paused": True}),
            ("POST", "/v1/scaling/sleep/scale", {"replicas": 2, "ttl_s": 60}),
            ("DELETE", "/v1/scaling/sleep/scale", None),
            ("POST", "/v1/workers/nobody/drain", None),
            ("POST", "/v1/deadletters/redrive", {"letter_ids": ["x"]}),
            ("POST", "/v1/deadletters/purge", {"letter_ids": ["x"]}),
            ("GET", "/v1/operator/snapshot", None),
            ("GET", "/v1/operator/stream", None),
        ]
        for method, path, body in controls:
            status = page.evaluate(
                "([m, p, b]) => fetch(p, {method: m, headers: {'Content-Type': 'application/json'},"
                " body: b === null ? undefined : JSON.stringify(b)}).then(r => r.status)",
                [method, path, body],
            )
            assert status == 401, f"{method} {path} without the token answered {status}"
        page.get_by_label("Operator token").fill("not-the-token")
        page.get_by_role("button", name="Log in").click()
        expect(page.locator("#login-error")).to_contain_text("403")
        expect(page.locator("#login")).to_be_visible()
        page.screenshot(path=ARTIFACTS / "login.png", full_page=True)
        page.get_by_label("Operator token").fill(TOKEN)
        page.get_by_role("button", name="Log in").click()
        expect(page.locator("#main")).to_be_visible()
        expect(card(page).locator("h3").first).to_have_text("sleep")
        assert scaling(up)["paused"] is False, "no call without the token changed anything"
    finally:
        page.context.close()


def test_theme_toggle_and_keyboard(up: Up, browser: Browser) -> None:
    page = browser.page
    background = "getComputedStyle(document.body).backgroundColor"
    assert page.evaluate(background) == "rgb(247, 248, 250)"
    page.emulate_media(color_scheme="dark")  # the system's scheme, until the toggle picks one
    assert page.evaluate(background) == "rgb(13, 17, 23)"
    expect(page.get_by_role("button", name="Light theme")).to_have_attribute("aria-pressed", "true")
    page.emulate_media(color_scheme="light")
    toggle = page.get_by_role("button", name="Dark theme")
    toggle.focus()
    page.keyboard.press("Enter")
    assert page.evaluate("document.documentElement.dataset.theme") == "dark"
    expect(page.get_by_role("button", name="Light theme")).to_have_attribute("aria-pressed", "true")
    page.screenshot(path=ARTIFACTS / "dark.png", full_page=True)
    page.get_by_role("button", name="Light theme").click()
    assert page.evaluate("document.documentElement.dataset.theme") == "light"
    # every input of the controls has a label, every control is a real button
    unlabelled = page.evaluate(
        "[...document.querySelectorAll('main input')].filter(i => !i.labels.length).map(i => i.outerHTML)"
    )
    assert unlabelled == []
    assert page.locator("main [onclick], main div[role=button]").count() == 0


def test_the_page_reads_at_a_glance_at_1280_px(up: Up, browser: Browser) -> None:
    page = browser.page
    # an idle model's decision is listed once, with how long it has stood (the autoscaler re-records it every 30 s)
    repeated = page.locator('article[data-model="echo"] .decisions li:not([data-repeats="1"])')
    until(lambda: repeated.count() > 0, 45, "a decision standing for several checks, on one line")
    expect(repeated.first).to_contain_text("unchanged since")
    # every card says why it wants the replicas it wants (the wordings are table-tested in test_operator_words.py;
    # which one echo shows here depends on what earlier tests of this module left in its queue)
    until(lambda: card(page, "echo").locator('[data-role="reason"]').inner_text().strip(), 10, "the echo card's reason")
    # with every card closed the whole page fits in well under 3,000 px at 1280 px wide
    for model in ("sleep", "gate", "echo"):
        if card(page, model).locator("details").evaluate("d => d.open"):
            card(page, model).locator("summary").click()
    assert page.viewport_size == {"width": 1280, "height": 900}
    height = page.evaluate("document.documentElement.scrollHeight")
    assert height < 2400, f"the collapsed page is {height} px tall at 1280 px"
    # the docs' screenshot: some load on sleep, its card open
    body = {"model": "sleep", "input": {"mean_ms": 200}}
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda _: up.api.post("/v1/jobs", json=body).json()["job_id"], range(60)))
    open_card(page)
    until(lambda: int(card(page).locator('[data-stat="replicas"]').inner_text()) >= 2, 15, "sleep scales out")
    page.locator("#runs tbody tr", has_text="dash").first.locator("button.link").click()
    page.locator("#recent-jobs tbody tr").first.get_by_role("button").click()
    time.sleep(3)  # a few samples on the charts
    page.screenshot(path=ARTIFACTS / "glance.png", full_page=True)
    until(lambda: all(up.api.get(f"/v1/jobs/{j}").json()["state"] == "succeeded" for j in ids[-3:]), 90, "the load")


def test_the_session_had_no_console_error_and_no_foreign_request(up: Up, browser: Browser) -> None:
    streams = [url for url in browser.requests if url.endswith("/v1/operator/stream")]
    assert len(streams) == 1, f"one live stream for the whole session: {streams}"
    assert_clean(up, browser)
    page = browser.page
    page.locator("#runs tbody tr", has_text="dash").first.locator("button.link").click()  # the three-step run
    expect(page.locator("#run-detail .run-graph svg")).to_be_visible()
    page.screenshot(path=ARTIFACTS / "overview.png", full_page=True)
    assert_clean(up, browser)
