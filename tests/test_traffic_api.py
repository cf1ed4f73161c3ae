"""``/v1/models/{name}/traffic`` and ``/comparisons`` as an operator and as an attacker, on NATS + Redis, and ``fleet
models traffic`` against a served gateway: the role check (a submitter key, and an operator key bound to a tenant
other than the default one, are 403 on every route), unknown models (404), versions that do not exist (422 naming
them), bad weights, garbage and oversized bodies (4xx, nothing written), compare-and-set against a concurrent
writer, the audit log and the timeline."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from typer.testing import CliRunner

from fleet.cli import app as cli_app
from fleet.store.rollouts import RolloutDoc
from tests.gateway_helpers import error_of
from tests.traffic_fixtures import TOKEN, TrafficEnv, env_fixture, without_lifespan  # noqa: F401  (fixtures)

pytestmark = pytest.mark.services

POLICY = {"primary": "1", "canary": "2", "canary_weight": 0.1, "shadow": "3", "shadow_share": 0.2}


def _path(env: TrafficEnv, route: str = "traffic") -> str:
    return f"/v1/models/{env.model}/{route}"


async def test_an_operator_sets_shows_and_clears_a_policy(env: TrafficEnv) -> None:
    rollout = {"steps": [0.1, 0.5, 1.0], "min_requests": 50}
    put = await env.operator.put(_path(env), json={"policy": POLICY, "rollout": rollout})
    assert put.status_code == 200, put.text
    doc = RolloutDoc.model_validate(put.json())
    assert doc.revision == 1 and doc.policy.canary_weight == 0.1 and doc.rollout is not None
    assert doc.updated_by is not None
    shown = await env.operator.get(_path(env))
    assert shown.status_code == 200 and RolloutDoc.model_validate(shown.json()) == doc
    again = await env.token.put(_path(env), json={"policy": {**POLICY, "canary_weight": 0.25}})
    assert again.status_code == 200 and again.json()["revision"] == 2 and again.json()["rollout"] is None
    decisions = await env.stores.rollouts.decisions(env.model)
    assert [d.action for d in decisions[:2]] == ["set", "set"]
    assert (
        decisions[0].weight == 0.25
        and decisions[0].previous_weight == 0.1
        and "canary 2 at 0.25" in decisions[0].reason
    )
    audit = await env.token.get("/v1/audit")
    assert audit.status_code == 200, audit.text
    actions = [e for e in audit.json()["entries"] if e.get("target") == env.model]
    assert {e["action"] for e in actions} >= {"traffic.set"}
    cleared = await env.operator.delete(_path(env))
    assert cleared.status_code == 204
    gone = await env.operator.get(_path(env))
    assert gone.status_code == 404 and error_of(gone)["type"] == "no_traffic_policy"
    assert env.traffic.doc(env.model) is None  # this gateway routes plainly at once
    assert (await env.operator.delete(_path(env))).status_code == 204  # twice is the same
    audit = await env.token.get("/v1/audit")
    assert "traffic.clear" in {e["action"] for e in audit.json()["entries"] if e.get("target") == env.model}


async def test_a_submitter_key_or_a_tenants_operator_key_is_refused_on_every_route(env: TrafficEnv) -> None:
    await env.set_policy(**POLICY)
    for client in (env.a, env.b, env.b_operator):
        calls = [
            client.get(_path(env)),
            client.put(_path(env), json={"policy": {"primary": "1"}}),
            client.delete(_path(env)),
            client.get(_path(env, "comparisons")),
        ]
        for response in await asyncio.gather(*calls):
            assert response.status_code == 403, response.text
            if client is env.b_operator:
                assert "every tenant's" in error_of(response)["message"]
    doc = await env.stores.rollouts.read(env.model)
    assert doc is not None and doc.policy.canary_weight == 0.1  # untouched


async def test_no_key_is_401(env: TrafficEnv) -> None:
    env.a.headers.pop("Authorization")
    response = await env.a.get(_path(env))
    assert response.status_code == 401


@pytest.mark.parametrize(
    ("policy", "field", "words"),
    [
        ({"primary": "9"}, "body.policy.primary", "no version '9'"),
        ({"primary": "1", "canary": "8", "canary_weight": 0.1}, "body.policy.canary", "no version '8'"),
        ({"primary": "1", "shadow": "bad/../x", "shadow_share": 0.1}, "body.policy.shadow", "version"),
        ({"primary": "1", "canary": "2", "canary_weight": 1.5}, "body.policy.canary_weight", "less than or equal"),
        ({"primary": "1", "canary": "2", "canary_weight": -0.1}, "body.policy.canary_weight", "greater than"),
        ({"primary": "1", "canary": "1", "canary_weight": 0.5}, "body.policy", "is the primary"),
        ({"primary": "1", "canary_weight": 0.5}, "body.policy", "without a canary"),
        ({"primary": "1", "sticky": {"source": "field"}}, "body.policy.sticky", "needs a 'name'"),
        ({"primary": "1", "surprise": True}, "body.policy.surprise", "Extra inputs"),
        ({"primary": ""}, "body.policy.primary", "at least 1"),
    ],
)
async def test_bad_policies_are_422_naming_the_field(
    env: TrafficEnv, policy: dict[str, Any], field: str, words: str
) -> None:
    response = await env.operator.put(_path(env), json={"policy": policy})
    assert response.status_code == 422, response.text
    error = error_of(response)
    assert error["type"] == "invalid_request" and words in error["message"], error
    assert any(d["loc"].startswith(field) for d in error["details"]), error
    assert await env.stores.rollouts.read(env.model) is None


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (b"[1, 2]", 422),
        (b'{"policy": null}', 422),
        (b'{"policy": {"primary": "1"}, "rollout": {"steps": [0.5, 0.2]}}', 422),
        (b'{"policy": {"primary": "1"}, "extra": 1}', 422),
        (b'{"policy": {"primary": "1", "canary_weight": NaN}}', 422),
        (b'{"policy": {"primary": "' + b"1" * 200_000 + b'"}}', 413),
    ],
)
async def test_garbage_and_oversized_bodies_are_refused(env: TrafficEnv, body: bytes, status: int) -> None:
    response = await env.operator.put(_path(env), content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error_of(response)
    assert await env.stores.rollouts.read(env.model) is None


async def test_unknown_models_are_404_on_every_route(env: TrafficEnv) -> None:
    for method in ("GET", "PUT", "DELETE"):
        response = await env.operator.request(method, "/v1/models/nosuch/traffic", json={"policy": {"primary": "1"}})
        assert response.status_code == 404 and error_of(response)["type"] == "unknown_model", response.text
    response = await env.operator.get("/v1/models/nosuch/comparisons")
    assert response.status_code == 404


async def test_a_change_waits_its_turn_against_a_concurrent_writer(env: TrafficEnv) -> None:
    """Concurrent PUTs each land once: the revisions count them all, none overwrote another unseen."""
    weights = [0.1, 0.2, 0.3, 0.4, 0.5]
    puts = [env.token.put(_path(env), json={"policy": {**POLICY, "canary_weight": w}}) for w in weights]
    answers = await asyncio.gather(*puts)
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    assert sorted(a.json()["revision"] for a in answers) == [1, 2, 3, 4, 5]
    doc = await env.stores.rollouts.read(env.model)
    assert doc is not None and doc.revision == 5


async def test_the_policy_survives_the_controller_writing_beside_it(env: TrafficEnv) -> None:
    """A breaker state the controller wrote is kept across a person's change for the versions still named."""
    from fleet.lifecycle.breaker import BreakerState

    await env.set_policy(**POLICY)
    doc = await env.stores.rollouts.read(env.model)
    assert doc is not None
    tripped = {"2": BreakerState(status="open", opened_at_s=1.0, reason="x"), "7": BreakerState()}
    assert await env.stores.rollouts.write(doc.model_copy(update={"breakers": tripped}), doc.revision)
    changed = await env.set_policy(**{**POLICY, "canary_weight": 0.2})
    assert set(changed["breakers"]) == {"2"} and changed["breakers"]["2"]["status"] == "open"


async def test_fleet_models_traffic_talks_to_a_served_gateway(env: TrafficEnv) -> None:
    """``fleet models traffic`` against the gateway over HTTP, run in a thread (typer runs its own event loop)."""
    runner = CliRunner()
    async with without_lifespan(env.app) as base:
        common = ["--url", base, "--api-key", TOKEN]

        def cli(*args: str) -> Any:
            return runner.invoke(cli_app, ["models", "traffic", *args, env.model, *common])

        argv = ["--primary", "1", "--canary", "2", "--weight", "0.1", "--shadow", "3", "--shadow-share", "0.2"]
        done = await asyncio.to_thread(cli, "set", *argv, "--sticky", "tenant")
        assert done.exit_code == 0, done.output
        shown = await asyncio.to_thread(cli, "show")
        assert shown.exit_code == 0 and '"canary_weight": 0.1' in shown.output and '"source": "tenant"' in shown.output
        bad = await asyncio.to_thread(cli, "set", "--primary", "1", "--canary", "5", "--weight", "0.1")
        assert bad.exit_code == 1 and "no version '5'" in bad.output and bad.output.count("\n") == 1, bad.output
        flag = await asyncio.to_thread(cli, "set", "--primary", "1", "--sticky", "cookie")
        assert flag.exit_code == 2 and "--sticky" in flag.output
        weight = await asyncio.to_thread(cli, "set", "--primary", "1", "--canary", "2", "--weight", "2")
        assert weight.exit_code == 2 and "canary_weight" in weight.output
        auto = await asyncio.to_thread(cli, "set", "--primary", "1", "--canary", "2", "--weight", "0.05", "--auto")
        assert auto.exit_code == 0 and '"steps"' in auto.output, auto.output
        cleared = await asyncio.to_thread(cli, "clear")
        assert cleared.exit_code == 0 and "removed" in cleared.output
        missing = await asyncio.to_thread(cli, "show")
        assert missing.exit_code == 1 and "no traffic policy" in missing.output
        refused = await asyncio.to_thread(
            runner.invoke, cli_app, ["models", "traffic", "show", env.model, "--url", base, "--api-key", "nope"]
        )
        assert refused.exit_code == 1 and refused.output.startswith("error:")
