"""Each task runtime served end to end from a repository folder: a real worker on NATS + Redis runs the tiny model
of ``tests.tiny_models`` that ``runtime_handler`` binds, and the stored results are what a bare transformers loop
over the same files computes. A worker whose entry was tampered with refuses to start, naming the file."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fleet.brokers.base import Broker
from fleet.consumers.runtimes import runtime_handler
from fleet.consumers.worker import Worker
from fleet.errors import ConfigError
from fleet.repository.entry import RepositoryEntry
from fleet.schemas.jobs import JobState
from fleet.settings import FleetSettings
from fleet.store.base import ResultStore
from tests.infra import connected_pair, publish_requests, settings_for, wait_terminal
from tests.tiny_models import TOPICS, add_entry, read_entry

pytestmark = pytest.mark.services

TEXTS = ["Ada Lovelace lived in London.", "a quick brown fox", "", "fleet serves models " * 20]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repository")
    add_entry(root, "vec", "embeddings", options={"dimensions": [8]})
    add_entry(root, "topics", "multi-label", options={"top_k": 0})
    add_entry(root, "ner", "token-classification")
    add_entry(root, "ranker", "rerank")
    return root


@pytest.fixture
def settings(nats_url: str, redis_url: str) -> FleetSettings:
    return settings_for("nats+redis", {"nats": nats_url, "redis": redis_url})


@contextlib.asynccontextmanager
async def serving(entry: RepositoryEntry, settings: FleetSettings) -> AsyncIterator[tuple[Broker, ResultStore]]:
    async with connected_pair(settings) as (broker, store):
        async with Worker(runtime_handler(entry)(), broker, store, settings=settings):
            yield broker, store


async def served_outputs(entry: RepositoryEntry, settings: FleetSettings, inputs: list[dict[str, Any]]) -> list[Any]:
    async with serving(entry, settings) as (broker, store):
        ids = await publish_requests(broker, entry.name, inputs, f"{entry.name}-{entry.version}")
        records = await wait_terminal(store, ids, timeout_s=60)
    assert {r.state for r in records.values()} == {JobState.succeeded}, [r.error for r in records.values()]
    return [records[i].output for i in ids]


def renamed(entry: RepositoryEntry, unique: str) -> RepositoryEntry:
    """The entry under a per-test model name (its own subjects and consumer group)."""
    return RepositoryEntry(f"{entry.name}-{unique}", entry.version, entry.folder, entry.weights_dir, entry.manifest)


def bare(folder: Path, auto: str) -> tuple[Any, Any]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = getattr(transformers, auto).from_pretrained(str(folder), use_safetensors=True).eval()
    return tokenizer, model


async def test_embeddings_served_from_the_repository(repo: Path, settings: FleetSettings, unique: str) -> None:
    entry = renamed(read_entry(repo, "vec"), unique)
    one, many, cut = await served_outputs(
        entry, settings, [{"text": TEXTS[0]}, {"texts": TEXTS}, {"texts": TEXTS, "dimensions": 8}]
    )
    tokenizer, model = bare(entry.folder, "AutoModel")
    enc = tokenizer(TEXTS, padding=True, truncation=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1).numpy()
    np.testing.assert_allclose(np.asarray(many["embeddings"]), expected, atol=1e-5)
    np.testing.assert_allclose(np.asarray(one["embedding"]), expected[0], atol=1e-5)
    assert many["dim"] == 32 and many["tokens"] == int(enc["attention_mask"].sum())
    head = expected[:, :8] / np.linalg.norm(expected[:, :8], axis=1, keepdims=True)
    assert cut["dim"] == 8
    np.testing.assert_allclose(np.asarray(cut["embeddings"]), head, atol=1e-5)


async def test_classification_served_from_the_repository(repo: Path, settings: FleetSettings, unique: str) -> None:
    entry = renamed(read_entry(repo, "topics"), unique)
    out, top = await served_outputs(entry, settings, [{"texts": TEXTS}, {"text": TEXTS[1], "top_k": 2}])
    tokenizer, model = bare(entry.folder, "AutoModelForSequenceClassification")
    with torch.inference_mode():
        logits = model(**tokenizer(TEXTS, padding=True, truncation=True, return_tensors="pt")).logits
    for row, labels in zip(torch.sigmoid(logits).tolist(), out["results"], strict=True):
        assert {x["label"]: x["score"] for x in labels} == pytest.approx(dict(zip(TOPICS, row, strict=True)), abs=1e-5)
        assert [x["score"] for x in labels] == sorted((x["score"] for x in labels), reverse=True)
    assert top["labels"] == out["results"][1][:2] and top["results"] is None


async def test_token_classification_served_from_the_repository(
    repo: Path, settings: FleetSettings, unique: str
) -> None:
    from transformers import pipeline

    entry = renamed(read_entry(repo, "ner"), unique)
    simple, first = await served_outputs(entry, settings, [{"texts": TEXTS}, {"texts": TEXTS, "aggregation": "first"}])
    tokenizer, model = bare(entry.folder, "AutoModelForTokenClassification")
    for how, out in (("simple", simple), ("first", first)):
        reference = pipeline("token-classification", model=model, tokenizer=tokenizer, aggregation_strategy=how)
        for text, found in zip(TEXTS, out["results"], strict=True):
            theirs = [(r["entity_group"], r["start"], r["end"], text[r["start"] : r["end"]]) for r in reference(text)]
            assert [(e["label"], e["start"], e["end"], e["text"]) for e in found] == theirs
    assert any(simple["results"]), "the tiny model tags something"


async def test_rerank_served_from_the_repository(repo: Path, settings: FleetSettings, unique: str) -> None:
    entry = renamed(read_entry(repo, "ranker"), unique)
    query = "who lived in london"
    (out,) = await served_outputs(entry, settings, [{"query": query, "texts": TEXTS, "top_n": 3, "return_text": True}])
    tokenizer, model = bare(entry.folder, "AutoModelForSequenceClassification")
    with torch.inference_mode():
        enc = tokenizer([query] * len(TEXTS), TEXTS, padding=True, truncation=True, return_tensors="pt")
        scores = torch.sigmoid(model(**enc).logits[:, 0]).tolist()
    best = sorted(range(len(TEXTS)), key=lambda i: -scores[i])[:3]
    assert [r["index"] for r in out["results"]] == best
    assert [r["score"] for r in out["results"]] == pytest.approx([scores[i] for i in best], abs=1e-5)
    assert [r["text"] for r in out["results"]] == [TEXTS[i] for i in best]
    assert out["tokens"] == int(enc["attention_mask"].sum())


async def test_a_worker_refuses_to_serve_a_tampered_entry(
    repo: Path, tmp_path: Path, settings: FleetSettings, unique: str
) -> None:
    entry = add_entry(tmp_path, f"tampered-{unique}", "classification")
    (entry.folder / "config.json").write_text((entry.folder / "config.json").read_text().replace("positive", "evil"))
    with pytest.raises(ConfigError, match=r"weight file config\.json does not match its sha256"):
        async with serving(read_entry(tmp_path, entry.name), settings):
            pass
