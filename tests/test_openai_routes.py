"""The OpenAI-compatible and rerank routes against a real ``fleet gateway`` and workers on NATS + Redis, keys on.

Clients from PyPI talk to it as they talk to OpenAI: the official ``openai`` client (``base_url`` the gateway's
``/v1``, ``api_key`` a Fleet key) and LangChain's ``OpenAIEmbeddings``; the rerank route is called in TEI's and
Cohere's shapes. The models are ``tests.openai_handlers``' (hash vectors with Matryoshka sizes, a word-overlap
reranker) and ``echo`` (a model of another kind); a second module, marked slow, serves the real ``embed``. Hostile
bodies must be refused with a 4xx in OpenAI's shape within ``REQUEST_BOUND_S`` while ``/healthz`` stays fast.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from langchain_openai import OpenAIEmbeddings

from tests.health_probe import HealthProbe
from tests.limits_fixtures import HEALTHZ_BOUND_S, REQUEST_BOUND_S
from tests.limits_fixtures import Gateway as Probed
from tests.openai_handlers import TOY_MAX_TEXTS, overlap, toy_vector
from tests.processes import fleet_process, run_fleet, wait_http_ready
from tests.services import free_port

pytestmark = pytest.mark.services

WORKER_MODELS = ("tests.openai_handlers:ToyEmbed", "tests.openai_handlers:Overlap")
GATEWAY_MODELS = ",".join([*WORKER_MODELS, "echo"])  # echo: a model of another kind, refused before any job


@contextlib.contextmanager
def serving(env: dict[str, str], models: str, workers: tuple[str, ...], folder: Path) -> Iterator[str]:
    """A ``fleet gateway`` serving ``models`` and one ``fleet worker`` per model of ``workers`` (real processes on
    the broker and store of ``env``, each ready before this yields the gateway's base URL); the processes are this
    fixture's own children, killed at its end."""
    port = free_port()
    with contextlib.ExitStack() as stack:
        gateway = stack.enter_context(
            fleet_process(
                "gateway", "--port", str(port), env={**env, "FLEET_MODELS": models}, log=folder / "gateway.log"
            )
        )
        for i, model in enumerate(workers):
            metrics_port, log = free_port(), folder / f"worker-{i}.log"
            argv = ("worker", "--model", model, "--metrics-port", str(metrics_port))
            worker = stack.enter_context(fleet_process(*argv, env=env, log=log))
            wait_http_ready(f"http://127.0.0.1:{metrics_port}/readyz", worker, log, timeout_s=240)
        base = f"http://127.0.0.1:{port}"
        wait_http_ready(f"{base}/readyz", gateway, folder / "gateway.log")
        yield base
        assert gateway.poll() is None, (folder / "gateway.log").read_text()[-3000:]


@dataclass
class Served:
    base: str
    key: str  # tenant "team-<token>"
    tight_key: str  # tenant "tight-<token>": one request, then its rate limit refuses for a long while
    log: Path
    opened: list[openai.OpenAI | httpx.Client] = field(default_factory=list)  # closed by the fixture

    def client(self, key: str | None = None) -> openai.OpenAI:
        client = openai.OpenAI(base_url=f"{self.base}/v1", api_key=key or self.key, max_retries=0, timeout=30)
        self.opened.append(client)
        return client

    def http_client(self) -> httpx.Client:
        """An httpx client for a framework's OpenAI client to use (LangChain's), closed with the fixture."""
        client = httpx.Client(timeout=30)
        self.opened.append(client)
        return client

    def close(self) -> None:
        for client in self.opened:
            client.close()

    def http(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {key or self.key}"}, timeout=30)


def _key(env: dict[str, str], tenant: str) -> str:
    made = run_fleet("keys", "create", "--tenant", tenant, "--role", "submitter", env=env)
    assert made.returncode == 0, made.stderr
    return made.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def served(redis_url: str, nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    token = uuid.uuid4().hex[:8]
    tight = f"tight-{token}"  # tenants of this module alone: their limits start whole in the session's Redis
    env = {
        "FLEET_BROKER_URL": nats_url,
        "FLEET_STORE_URL": redis_url,
        "FLEET_AUTH": "keys",
        "FLEET_TENANT_LIMITS": json.dumps({tight: {"rate": 0.001, "burst": 1}}),
        "FLEET_CACHE": "toy-embed=l1+l2",
        "FLEET_LOG_LEVEL": "WARNING",
    }
    key, tight_key = _key(env, f"team-{token}"), _key(env, tight)
    folder = tmp_path_factory.mktemp("openai")
    with serving(env, GATEWAY_MODELS, WORKER_MODELS, folder) as base:
        fixture = Served(base, key, tight_key, folder / "gateway.log")
        yield fixture
        fixture.close()


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(got, want, strict=True))


def openai_error(response: httpx.Response) -> dict:
    """The ``error`` of an OpenAI-shaped error body, checking the envelope on the way."""
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return body["error"]


# -- embeddings with the openai client ------------------------------------------------------------------------
def test_the_openai_client_embeds_one_string(served: Served) -> None:
    answer = served.client().embeddings.create(model="toy-embed", input="hello wide world")
    assert answer.object == "list" and answer.model == "toy-embed"
    [item] = answer.data
    assert item.object == "embedding" and item.index == 0
    assert close(item.embedding, toy_vector("hello wide world"))  # the client asked base64 and decoded it
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == 3  # the model's own count: words


def test_a_list_longer_than_a_job_runs_several_jobs_and_keeps_its_order(served: Served) -> None:
    texts = [f"text number {i}" for i in range(TOY_MAX_TEXTS * 2 + 3)]  # three jobs
    answer = served.client().embeddings.create(model="toy-embed", input=texts, encoding_format="float")
    assert [d.index for d in answer.data] == list(range(len(texts)))
    assert all(close(d.embedding, toy_vector(t)) for d, t in zip(answer.data, texts, strict=True))
    assert answer.usage.prompt_tokens == 3 * len(texts)


def test_base64_is_float32_little_endian_as_openai_sends_it(served: Served) -> None:
    answer = served.client().embeddings.create(model="toy-embed", input=["a", "b"], encoding_format="base64")
    for item, text in zip(answer.data, ["a", "b"], strict=True):
        assert isinstance(item.embedding, str)
        vector = np.frombuffer(base64.b64decode(item.embedding), dtype="<f4").tolist()
        assert close(vector, toy_vector(text))


def test_dimensions_keeps_a_matryoshka_size_and_refuses_another(served: Served) -> None:
    client = served.client()
    answer = client.embeddings.create(model="toy-embed", input=["x y", "z"], dimensions=4)
    assert [close(d.embedding, toy_vector(t, 4)) for d, t in zip(answer.data, ["x y", "z"], strict=True)] == [True] * 2
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="toy-embed", input="x", dimensions=5)
    assert refused.value.status_code == 400 and "dimensions 5" in refused.value.message
    assert refused.value.code == "invalid_input"


def test_models_list_and_retrieve(served: Served) -> None:
    client = served.client()
    listed = {m.id: m for m in client.models.list()}
    assert set(listed) == {"toy-embed", "overlap", "echo"}
    assert all(m.object == "model" and m.owned_by == "fleet" and m.created > 0 for m in listed.values())
    kinds = {name: m.model_extra["kind"] for name, m in listed.items()}  # Fleet's fields ride along
    assert kinds == {"toy-embed": "embeddings", "overlap": "rerank", "echo": "other"}
    assert client.models.retrieve("overlap").id == "overlap"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("nope")
    assert missing.value.code == "model_not_found"


def test_any_key_of_another_tenant_lists_the_models_and_a_bad_key_is_401(served: Served) -> None:
    assert {m.id for m in served.client(served.tight_key).models.list()} == {"toy-embed", "overlap", "echo"}
    with pytest.raises(openai.AuthenticationError) as bad:
        served.client("fleet_not-a-key").embeddings.create(model="toy-embed", input="x")
    assert bad.value.code == "invalid_api_key"
    with httpx.Client(base_url=served.base) as http:
        bare = http.post("/v1/embeddings", json={"model": "toy-embed", "input": "x"})
    assert bare.status_code == 401 and openai_error(bare)["code"] == "invalid_api_key"
    assert bare.headers["www-authenticate"] == "Bearer"


def test_a_tenants_rate_limit_is_a_429_in_openai_shape_and_leaves_other_tenants_alone(served: Served) -> None:
    tight = served.client(served.tight_key)
    tight.embeddings.create(model="toy-embed", input="first")  # its burst of one
    with pytest.raises(openai.RateLimitError) as limited:
        tight.embeddings.create(model="toy-embed", input="second")
    assert limited.value.code == "rate_limited" and int(limited.value.response.headers["retry-after"]) >= 1
    assert limited.value.body["type"] == "rate_limit_error"  # type: ignore[index]
    assert served.client().embeddings.create(model="toy-embed", input="second").data


def _metric(base: str, prefix: str) -> float:
    lines = [line for line in httpx.get(f"{base}/metrics").text.splitlines() if line.startswith(prefix)]
    return sum(float(line.split()[-1]) for line in lines)


def test_the_jobs_are_ordinary_jobs_counted_in_the_metrics(served: Served) -> None:
    def submitted() -> float:
        return _metric(served.base, 'fleet_gateway_jobs_submitted_total{model="toy-embed"}')

    before = submitted()
    served.client().embeddings.create(model="toy-embed", input=[f"m {i}" for i in range(TOY_MAX_TEXTS + 1)])
    assert submitted() == before + 2


def test_the_result_caches_answer_a_repeated_request(served: Served) -> None:
    hits = 'fleet_cache_requests_total{level="l1",model="toy-embed",result="hit"}'
    texts = [f"cached {uuid.uuid4().hex} {i}" for i in range(TOY_MAX_TEXTS + 1)]  # two jobs
    first = served.client().embeddings.create(model="toy-embed", input=texts)
    before = _metric(served.base, hits)
    again = served.client().embeddings.create(model="toy-embed", input=texts)
    assert _metric(served.base, hits) == before + 2  # both jobs, from this gateway's L1
    assert [d.embedding for d in again.data] == [d.embedding for d in first.data]


def test_priority_is_fleets_extension_of_the_body(served: Served) -> None:
    client = served.client()
    assert client.embeddings.create(model="toy-embed", input="urgent", extra_body={"priority": "high"}).data
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="toy-embed", input="x", extra_body={"priority": "asap"})
    assert refused.value.param == "priority"  # type: ignore[attr-defined]


# -- LangChain --------------------------------------------------------------------------------------------------
def test_langchain_openai_embeddings_against_the_gateway(served: Served) -> None:
    embeddings = OpenAIEmbeddings(
        model="toy-embed",
        base_url=f"{served.base}/v1",
        api_key=served.key,  # type: ignore[arg-type]
        check_embedding_ctx_length=False,  # no tiktoken download: texts go as they are
        max_retries=0,
        http_client=served.http_client(),
    )
    assert close(embeddings.embed_query("what is fleet"), toy_vector("what is fleet"))
    docs = [f"document {i}" for i in range(TOY_MAX_TEXTS + 5)]
    vectors = embeddings.embed_documents(docs)
    assert all(close(v, toy_vector(d)) for v, d in zip(vectors, docs, strict=True))


# -- rerank -----------------------------------------------------------------------------------------------------
PASSAGES = ["the cat sat on the mat", "stock markets fell", "a cat and a dog", "cats sat"]
QUERY = "cat sat mat"


def expected_order() -> list[int]:
    return sorted(range(len(PASSAGES)), key=lambda i: (-overlap(QUERY, PASSAGES[i]), i))


def test_rerank_in_teis_shape_answers_teis_list(served: Served) -> None:
    with served.http() as http:
        answer = http.post("/v1/rerank", json={"query": QUERY, "texts": PASSAGES, "return_text": True})
    assert answer.status_code == 200, answer.text
    ranks = answer.json()
    assert [r["index"] for r in ranks] == expected_order()
    assert all(math.isclose(r["score"], overlap(QUERY, PASSAGES[r["index"]])) for r in ranks)
    assert all(r["text"] == PASSAGES[r["index"]] for r in ranks)


def test_rerank_in_coheres_shape_answers_coheres_object(served: Served) -> None:
    documents = [PASSAGES[0], {"text": PASSAGES[1]}, PASSAGES[2], {"text": PASSAGES[3]}]
    body = {"model": "overlap", "query": QUERY, "documents": documents, "top_n": 2, "return_documents": True}
    with served.http() as http:
        answer = http.post("/v1/rerank", json=body)
        plain = http.post("/v1/rerank", json={"query": QUERY, "documents": PASSAGES})
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert set(got) == {"id", "results", "meta", "usage"} and got["meta"]["billed_units"]["search_units"] == 1
    assert [r["index"] for r in got["results"]] == expected_order()[:2]
    assert [r["document"]["text"] for r in got["results"]] == [PASSAGES[i] for i in expected_order()[:2]]
    assert got["usage"]["total_tokens"] > 0
    assert [set(r) for r in plain.json()["results"]] == [{"index", "relevance_score"}] * len(PASSAGES)


def test_rerank_of_more_passages_than_a_job_takes_merges_the_jobs(served: Served) -> None:
    documents = [f"filler passage {i}" for i in range(300)]  # Overlap takes 256 a job: two jobs
    documents[7], documents[290] = "cat sat on a mat", "the cat sat"
    with served.http() as http:
        answer = http.post("/v1/rerank", json={"query": QUERY, "documents": documents, "top_n": 2})
    assert answer.status_code == 200, answer.text
    assert [r["index"] for r in answer.json()["results"]] == [7, 290]
    assert answer.json()["meta"]["billed_units"]["search_units"] == 2


def test_rerank_refuses_a_model_of_another_kind_and_mixed_shapes(served: Served) -> None:
    with served.http() as http:
        wrong = http.post("/v1/rerank", json={"model": "toy-embed", "query": "q", "texts": ["a"]})
        both = http.post("/v1/rerank", json={"query": "q", "texts": ["a"], "documents": ["b"]})
        raw = http.post("/v1/rerank", json={"query": "q", "texts": ["a"], "raw_scores": True})
    assert wrong.status_code == 400 and openai_error(wrong)["code"] == "model_not_supported"
    assert openai_error(wrong)["param"] == "model" and "overlap" in openai_error(wrong)["message"]
    assert both.status_code == 400 and "exactly one" in openai_error(both)["message"]
    assert raw.status_code == 400 and openai_error(raw)["param"] == "raw_scores"


# -- hostile input ----------------------------------------------------------------------------------------------
HOSTILE = {
    "empty string": ("/v1/embeddings", {"model": "toy-embed", "input": ""}, 400),
    "empty list": ("/v1/embeddings", {"model": "toy-embed", "input": []}, 400),
    "10,000 strings": ("/v1/embeddings", {"model": "toy-embed", "input": ["x"] * 10_000}, 400),
    "nested garbage": ("/v1/embeddings", {"model": "toy-embed", "input": [[["x"]], {"a": [1]}] * 500}, 400),
    "token ids": ("/v1/embeddings", {"model": "toy-embed", "input": [[101, 2023, 102]]}, 400),
    "a model of another kind": ("/v1/embeddings", {"model": "echo", "input": "x"}, 400),
    "an unknown model": ("/v1/embeddings", {"model": "gpt-4", "input": "x"}, 404),
    "a text over the model's limit": ("/v1/embeddings", {"model": "toy-embed", "input": ["ok", "x" * 20_001]}, 400),
    "an unknown field": ("/v1/embeddings", {"model": "toy-embed", "input": "x", "temperature": 1}, 400),
    "not an object": ("/v1/embeddings", ["toy-embed", "x"], 400),
    "10,000 documents": ("/v1/rerank", {"query": "q", "documents": ["x"] * 10_000}, 400),
    "rerank with no query": ("/v1/rerank", {"texts": ["a"]}, 400),
}


@pytest.fixture(scope="module")
def probed(served: Served) -> Iterator[Probed]:
    with served.http() as http, HealthProbe(served.base) as probe:
        yield Probed(served.base, "echo", http, probe)
        assert not probe.errors, probe.errors[:5]


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_bodies_are_refused_fast_in_openai_shape(probed: Probed, case: str) -> None:
    path, body, status = HOSTILE[case]
    response, seconds, worst = probed.send("POST", path, json=body)
    assert response.status_code == status, response.text
    error = openai_error(response)
    assert error["type"] == "invalid_request_error" and len(error["message"]) < 1000, error
    assert seconds < REQUEST_BOUND_S and worst < HEALTHZ_BOUND_S, (seconds, worst)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/rerank"])
def test_a_body_of_10_mb_is_413_in_openai_shape(probed: Probed, path: str) -> None:
    body = json.dumps({"model": "toy-embed", "query": "q", "input": "x" * 10_000_000, "texts": ["a"]})
    response, seconds, worst = probed.send("POST", path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 413 and openai_error(response)["code"] == "payload_too_large"
    assert seconds < REQUEST_BOUND_S and worst < HEALTHZ_BOUND_S, (seconds, worst)


def test_malformed_json_is_400_in_openai_shape(probed: Probed) -> None:
    response, _, _ = probed.send(
        "POST", "/v1/embeddings", content=b'{"model": "toy-', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and openai_error(response)["code"] == "malformed_json"


def test_the_rest_of_the_api_keeps_its_own_error_shape(served: Served) -> None:
    with served.http() as http:
        response = http.post("/v1/jobs", json={"model": "gpt-4", "input": {}})
    assert response.status_code == 404 and set(response.json()["error"]) == {"type", "message", "details"}


def test_openapi_documents_the_routes_with_examples(served: Served) -> None:
    spec = httpx.get(f"{served.base}/openapi.json").json()
    embeddings = spec["paths"]["/v1/embeddings"]["post"]
    body = embeddings["requestBody"]["content"]["application/json"]
    assert set(body["schema"]["properties"]) >= {"input", "model", "encoding_format", "dimensions", "user"}
    assert body["examples"] and "example" in embeddings["responses"]["200"]["content"]["application/json"]
    assert embeddings["responses"]["429"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/OpenAIErrorResponse"
    )
    rerank = spec["paths"]["/v1/rerank"]["post"]["requestBody"]["content"]["application/json"]
    assert {"TEI", "Cohere"} <= set(rerank["examples"]) and "$defs" not in json.dumps(rerank)
    assert {"/v1/models", "/v1/models/{model}"} <= set(spec["paths"])


# -- the real embed model ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def embed_base(redis_url: str, nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    env = {"FLEET_BROKER_URL": nats_url, "FLEET_STORE_URL": redis_url, "FLEET_LOG_LEVEL": "WARNING"}
    with serving(env, "embed", ("embed",), tmp_path_factory.mktemp("openai-embed")) as base:  # the worker loads MiniLM
        yield base


def cosine(a: list[float], b: list[float]) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.slow
@pytest.mark.timeout(300)  # its fixture waits for the worker to load and warm MiniLM: minutes on a loaded machine
def test_the_openai_client_and_langchain_on_the_real_embed_model(embed_base: str) -> None:
    with (
        openai.OpenAI(base_url=f"{embed_base}/v1", api_key="unused: FLEET_AUTH is off", max_retries=0) as client,
        httpx.Client(timeout=60) as http_client,
    ):
        check_embed(client, http_client, embed_base)


def check_embed(client: openai.OpenAI, http_client: httpx.Client, embed_base: str) -> None:
    texts = ["a cat sits on the mat", "a kitten rests on a rug", "tax law changed in 2020"]
    answer = client.embeddings.create(model="embed", input=texts)
    cat, kitten, tax = (d.embedding for d in answer.data)
    assert len(cat) == 384 and cosine(cat, kitten) > cosine(cat, tax) + 0.2
    assert answer.usage.prompt_tokens > 0
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="embed", input="x", dimensions=128)
    assert "dimensions" in refused.value.message  # embed declares no Matryoshka sizes
    langchain = OpenAIEmbeddings(
        model="embed",
        base_url=f"{embed_base}/v1",
        api_key="unused",  # type: ignore[arg-type]
        check_embedding_ctx_length=False,
        max_retries=0,
        http_client=http_client,
    )
    query = langchain.embed_query("a cat sits on the mat")
    assert cosine(query, cat) > 0.999
    assert [
        cosine(v, w) > 0.999 for v, w in zip(langchain.embed_documents(texts), [cat, kitten, tax], strict=True)
    ] == [True] * 3
