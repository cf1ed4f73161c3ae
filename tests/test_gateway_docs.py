"""``/docs`` and ``/redoc`` work air-gapped: every asset they reference is served by the gateway itself."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

import pytest

from tests.test_gateway import Env, open_env

# src= and href= of script and link tags (the favicon is a link tag too).
ASSET_RE = re.compile(r"<(?:script|link)\b[^>]*?\b(?:src|href)=[\"']([^\"']+)[\"']", re.IGNORECASE)
TYPES = {".js": "javascript", ".css": "text/css", ".png": "image/png"}


@pytest.fixture
async def env(request: pytest.FixtureRequest, unique: str) -> AsyncIterator[Env]:
    async with open_env(request, "memory", unique) as e:
        yield e


@pytest.mark.parametrize(("page", "expected"), [("/docs", 3), ("/redoc", 2)])
async def test_the_page_references_no_other_host_and_each_asset_answers(env: Env, page: str, expected: int) -> None:
    response = await env.client.get(page)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    html = response.text
    assert not re.search(r"https?://", html), f"{page} names an external URL: {re.findall(r'https?://[^ ]+', html)}"
    assets = ASSET_RE.findall(html)
    assert len(assets) == expected, assets  # js (+ css) + favicon
    for url in assets:
        assert url.startswith("/docs-assets/"), url
        asset = await env.client.get(url)
        assert asset.status_code == 200, url
        kind = TYPES[url[url.rindex(".") :]]
        assert kind in asset.headers["content-type"], (url, asset.headers["content-type"])
        assert len(asset.content) > 1000, url
    assert "/openapi.json" in html
    assert (await env.client.get("/openapi.json")).json()["info"]["title"] == "Fleet gateway"


async def test_swagger_ui_oauth2_redirect_page_is_served(env: Env) -> None:
    response = await env.client.get("/docs/oauth2-redirect")
    assert response.status_code == 200 and "oauth2" in response.text.lower()
    assert not re.search(r"<script[^>]+src=[\"']https?://", response.text)


async def test_docs_pages_stay_out_of_the_openapi_document(env: Env) -> None:
    paths = (await env.client.get("/openapi.json")).json()["paths"]
    assert not {"/docs", "/redoc", "/docs/oauth2-redirect"} & set(paths)


OPENAI_SHAPED = {"/v1/embeddings", "/v1/rerank"}  # fleet.producers.gateway.models: errors in OpenAI's shape


async def test_every_route_with_a_json_body_answers_malformed_json_with_400_as_the_schema_says(env: Env) -> None:
    schema = (await env.client.get("/openapi.json")).json()
    tried = []
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            if "application/json" not in operation.get("requestBody", {}).get("content", {}):
                continue
            assert "400" in operation["responses"], f"{method.upper()} {path} does not document 400"
            url = re.sub(r"\{model\}", "echo", path)
            url = re.sub(r"\{[^}]+\}", "no-such-id", url)
            response = await env.client.request(
                method.upper(),
                url,
                content=b'{"model": "echo", "input": ',
                headers={"content-type": "application/json"},
            )
            assert response.status_code == 400, (method, path, response.status_code, response.text)
            # a DAG spec may be YAML or JSON: text that parses as neither is malformed_spec, with its line and column
            expected = "malformed_spec" if path == "/v1/dags" else "malformed_json"
            error = response.json()["error"]
            kind = error["code"] if path in OPENAI_SHAPED else error["type"]  # OpenAI's shape: the kind is the code
            assert kind == expected, (method, path, response.text)
            tried.append(f"{method.upper()} {path}")
    assert {"POST /v1/jobs", "POST /v1/infer", "PUT /v1/scaling/{model}", "POST /v1/embeddings"} <= set(tried), tried


async def test_the_submit_body_is_one_schema_per_served_model_and_wait_says_its_bounds(env: Env) -> None:
    schema = (await env.client.get("/openapi.json")).json()
    components = schema["components"]["schemas"]
    for path in ("/v1/jobs", "/v1/infer"):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        mapping = body["discriminator"]["mapping"]
        assert set(mapping) == {env.echo, env.sleep, env.embed}, mapping
        assert len(body["oneOf"]) == 3
    sleep = components[mapping[env.sleep].rsplit("/", 1)[1]]
    assert sleep["properties"]["model"]["const"] == env.sleep
    sleep_input = components[sleep["properties"]["input"]["$ref"].rsplit("/", 1)[1]]
    assert sleep_input["properties"]["mean_ms"]["maximum"] > 0 and sleep_input["additionalProperties"] is False
    embed = components[mapping[env.embed].rsplit("/", 1)[1]]
    embed_input = components[embed["properties"]["input"]["$ref"].rsplit("/", 1)[1]]
    assert {"text", "texts"} <= set(embed_input["properties"]), "the model's own input, not an untyped object"
    refs = re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(schema))
    assert set(refs) <= set(components), f"dangling references: {set(refs) - set(components)}"
    for path in ("/v1/jobs/{job_id}", "/v1/runs/{run_id}"):
        (wait,) = [p for p in schema["paths"][path]["get"]["parameters"] if p["name"] == "wait"]
        bounded = wait["schema"]["anyOf"][0]
        assert bounded["exclusiveMinimum"] == 0 and bounded["maximum"] == env.settings.max_long_poll_s, wait
