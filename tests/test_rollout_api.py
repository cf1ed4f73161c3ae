"""``GET /v1/models/{name}/rollout``, ``POST .../promote`` and ``.../rollback`` on a gateway with API keys over real
Redis: the view (shares, windows, breakers, decisions), a promote and a rollback carried out at once with who did it
on the timeline and in the audit log, refused for a submitter key, another tenant's operator key and no key; 404 and
409 where there is nothing to move; and ``fleet models promote | rollback | rollout`` against the served gateway."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
from typer.testing import CliRunner, Result

from fleet.cli import app as cli_app
from fleet.lifecycle.breaker import BreakerState
from fleet.lifecycle.controller import RolloutConfig, RolloutState
from fleet.lifecycle.traffic import TrafficPolicy
from fleet.settings import FleetSettings
from fleet.store import make_store
from fleet.store.bundle import Stores
from fleet.store.rollouts import DecisionEntry, RolloutDoc
from tests.gateway_helpers import asgi_gateway, error_of, model_refs, served

TOKEN = "rollout-operator-token"


@dataclass
class Env:
    app: object
    http: httpx.AsyncClient
    stores: Stores
    model: str
    keys: dict[str, str]

    def auth(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[who]}"}


@pytest.fixture
async def env(redis_url: str, unique: str) -> AsyncIterator[Env]:
    refs, names = model_refs(unique, "echo")
    settings = FleetSettings(models=refs, auth="keys", operator_token=TOKEN, store_url=redis_url, rollout_window_s=60)
    store = make_store(settings)
    await store.connect()
    stores = Stores.beside(store)
    keys = {
        "operator": (await stores.keys.create("default", "operator", None))[0],
        "other": (await stores.keys.create(f"t-{unique}", "operator", None))[0],
        "submitter": (await stores.keys.create("default", "submitter", None))[0],
        "token": TOKEN,
    }
    try:
        async with asgi_gateway(settings, store=store, stores=stores) as (app, http):
            yield Env(app, http, stores, names[0], keys)
    finally:
        await store.close()


async def put_doc(env: Env, weight: float = 0.25, shadow: bool = True) -> RolloutDoc:
    policy = TrafficPolicy(
        primary="1", canary="2", canary_weight=weight, shadow="3" if shadow else None, shadow_share=0.1 if shadow else 0
    )
    doc = RolloutDoc(model=env.model, policy=policy, rollout=RolloutConfig(), state=RolloutState(step=2))
    doc.breakers["2"] = BreakerState(
        status="open", opened_at_s=1e12, cool_down_s=5.0, reason="opened: 5 consecutive failures"
    )
    assert await env.stores.rollouts.write(doc, 0)
    stored = await env.stores.rollouts.read(env.model)
    assert stored is not None
    return stored


async def test_the_view_shows_shares_windows_breakers_and_decisions(env: Env) -> None:
    await put_doc(env)
    for i in range(20):
        await env.stores.rollouts.record_outcome(env.model, "1", ok=True, latency_ms=10.0)
        await env.stores.rollouts.record_outcome(env.model, "2", ok=i % 4 != 0, latency_ms=30.0)
    await env.stores.rollouts.record_agreement(env.model, "3", 0.5)
    await env.stores.rollouts.record_agreement(env.model, "3", 1.0)
    await env.stores.rollouts.add_decision(
        DecisionEntry(at=1.0, model=env.model, action="step", weight=0.25, previous_weight=0.1, reason="within limits")
    )
    answer = await env.http.get(f"/v1/models/{env.model}/rollout", headers=env.auth("operator"))
    assert answer.status_code == 200, answer.text
    view = answer.json()
    shown = {v["version"]: v for v in view["versions"]}
    assert [(v["version"], v["role"], v["share"]) for v in view["versions"]] == [
        ("1", "primary", 0.75),
        ("2", "canary", 0.25),
        ("3", "shadow", 0.1),
    ]
    assert (shown["2"]["requests"], shown["2"]["failures"], shown["2"]["error_rate"]) == (20, 5, 0.25)
    assert 30 <= shown["2"]["p99_ms"] <= 33 and shown["1"]["breaker"]["status"] == "closed"
    assert shown["2"]["breaker"]["status"] == "open" and shown["2"]["breaker"]["retry_after_s"] > 0
    assert (shown["3"]["agreement"], shown["3"]["agreement_samples"]) == (0.75, 2)
    assert [d["reason"] for d in view["decisions"]] == ["within limits"] and view["window_s"] == 60
    listed = (await env.http.get("/v1/rollouts", headers=env.auth("token"))).json()
    assert env.model in [v["model"] for v in listed]


async def test_promote_is_carried_out_at_once_and_names_who_on_the_timeline_and_in_the_audit_log(env: Env) -> None:
    await put_doc(env)
    answer = await env.http.post(f"/v1/models/{env.model}/promote", headers=env.auth("operator"))
    assert answer.status_code == 200, answer.text
    view = answer.json()
    assert view["doc"]["policy"]["primary"] == "2" and view["doc"]["policy"]["canary"] is None
    assert view["doc"]["state"]["phase"] == "promoted" and view["doc"]["revision"] == 2
    assert "2" in view["doc"]["breakers"] and "1" not in [v["version"] for v in view["versions"]]
    [entry] = view["decisions"]
    assert (
        entry["action"] == "promote"
        and entry["by"].startswith("key:")
        and entry["reason"].startswith("promoted by key:")
    )
    audit = (await env.http.get("/v1/audit?limit=5", headers=env.auth("operator"))).json()["entries"]
    assert (audit[0]["action"], audit[0]["target"]) == ("rollout.promote", env.model)
    assert audit[0]["details"]["version"] == "2" and audit[0]["details"]["from_weight"] == 0.25
    again = await env.http.post(f"/v1/models/{env.model}/promote", headers=env.auth("operator"))
    assert again.status_code == 409 and error_of(again)["type"] == "no_canary"


async def test_rollback_sets_the_canary_to_zero_and_keeps_it_named(env: Env) -> None:
    await put_doc(env, weight=0.5, shadow=False)
    answer = await env.http.post(f"/v1/models/{env.model}/rollback", headers=env.auth("token"))
    assert answer.status_code == 200, answer.text
    policy = answer.json()["doc"]["policy"]
    assert (policy["primary"], policy["canary"], policy["canary_weight"]) == ("1", "2", 0.0)
    [entry] = await env.stores.rollouts.decisions(env.model)
    assert (entry.action, entry.by, entry.reason) == (
        "roll_back",
        "operator-token",
        "rolled back by operator-token from 50 % to 0 %",
    )
    # the controller left it rolled back; a person may still promote it
    promoted = await env.http.post(f"/v1/models/{env.model}/promote", headers=env.auth("token"))
    assert promoted.status_code == 200 and promoted.json()["doc"]["policy"]["primary"] == "2"


@pytest.mark.parametrize(
    ("who", "status", "kind"),
    [("submitter", 403, "forbidden"), ("other", 403, "forbidden"), (None, 401, "unauthorized")],
)
async def test_a_submitter_another_tenant_or_nobody_is_refused_and_nothing_moves(
    env: Env, who: str | None, status: int, kind: str
) -> None:
    before = await put_doc(env)
    headers = env.auth(who) if who else {}
    for action in ("promote", "rollback"):
        answer = await env.http.post(f"/v1/models/{env.model}/{action}", headers=headers)
        assert answer.status_code == status, answer.text
        assert error_of(answer)["type"] == kind
    if who == "other":
        assert "tenant" in error_of(answer)["message"]
    assert (await env.stores.rollouts.read(env.model)) == before
    assert await env.stores.rollouts.decisions(env.model) == []
    if who == "submitter":
        assert (await env.http.get(f"/v1/models/{env.model}/rollout", headers=headers)).status_code == 403


async def test_unknown_models_models_without_a_policy_and_bad_names(env: Env) -> None:
    headers = env.auth("operator")
    unknown = await env.http.post("/v1/models/nope-x/promote", headers=headers)
    assert unknown.status_code == 404 and "nope-x" in error_of(unknown)["message"]
    bare = await env.http.get(f"/v1/models/{env.model}/rollout", headers=headers)
    assert bare.status_code == 404 and error_of(bare)["type"] == "no_traffic_policy"
    assert (await env.http.post(f"/v1/models/{env.model}/rollback", headers=headers)).status_code == 404
    for bad in ("Bad", "a" * 64, "x%2Fy", "-x"):
        assert (await env.http.post(f"/v1/models/{bad}/promote", headers=headers)).status_code in (404, 422), bad
    too_many = await env.http.get(f"/v1/models/{env.model}/rollout?decisions=100000", headers=headers)
    assert too_many.status_code == 422


def fleet(*args: str, **env: str) -> Result:
    return CliRunner().invoke(cli_app, ["models", *args], prog_name="fleet", env=env or None)


async def test_the_cli_promotes_rolls_back_and_shows_in_one_line_each(env: Env) -> None:
    await put_doc(env)
    async with served(env.app) as base:  # type: ignore[arg-type]
        shown = await asyncio.to_thread(fleet, "rollout", env.model, "--url", base, FLEET_API_KEY=TOKEN)
        assert shown.exit_code == 0, shown.output
        assert "canary" in shown.output and "open" in shown.output
        refused = await asyncio.to_thread(
            fleet, "rollback", env.model, "--url", base, FLEET_API_KEY=env.keys["submitter"]
        )
        assert refused.exit_code == 1 and refused.output.count("\n") == 1 and "operator" in refused.output
        done = await asyncio.to_thread(fleet, "rollback", env.model, "--url", base, FLEET_API_KEY=TOKEN)
        assert done.exit_code == 0 and "rolled back by operator-token from 25 % to 0 %" in done.output, done.output
        done = await asyncio.to_thread(fleet, "promote", env.model, "--url", base, FLEET_API_KEY=TOKEN)
        assert done.exit_code == 0 and "primary is now 2" in done.output, done.output
        again = await asyncio.to_thread(fleet, "promote", env.model, "--url", base, FLEET_API_KEY=TOKEN)
        assert again.exit_code == 1 and "no canary" in again.output and again.output.count("\n") == 1
