"""The L3 embedder is a setting per model (``ModelSpec.cache_embedder``, ``cache.embedder`` in ``model.yaml``): the
gateway loads each distinct embedder once, keys each model's L3 with its own embedder's vectors, and refuses at
start-up a model whose embedder it cannot load, naming the model and the embedder."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from fleet.errors import ConfigError
from fleet.producers.gateway.cache.embedder import EMBEDDERS, BatchingEmbedder, check_embedders, load_embedder
from fleet.producers.gateway.cache.results import ResultCache, build_cache
from fleet.repository.entry import RepositoryEntry, spec_for
from fleet.schemas.jobs import JobRecord, JobState
from fleet.schemas.manifest import ModelManifest
from fleet.schemas.models import ECHO, EMBED_DIM, ModelSpec
from fleet.settings import FleetSettings
from fleet.store.cachestore import CacheStore, MemoryCacheStore, RedisCacheStore
from fleet.store.redis import RedisStore
from tests.processes import run_fleet

# ``fleet gateway`` resolves this by import path: a text model whose L3 embedder no gateway can load
EXTRACT_TYPO = dataclasses.replace(
    ECHO, name="extract-typo", cache_text="text", cache_threshold=0.93, cache_embedder="minilm-typo"
)


class WordsModel:
    """A stand-in embedder: a unit vector from the text's lower-cased words, so two texts with the same words in
    another order or case are the same vector. ``seed`` makes two embedders disagree on every vector."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.texts: list[str] = []

    def embed_texts(self, texts: list[str]) -> list[list[float]]:
        self.texts.extend(texts)
        out = []
        for text in texts:
            vector = np.zeros(EMBED_DIM, dtype=np.float32)
            for word in text.lower().replace(",", " ").replace(".", " ").split():
                digest = hashlib.sha256(f"{self.seed}:{word}".encode()).digest()
                vector[int.from_bytes(digest[:4], "little") % EMBED_DIM] += 1.0
            out.append((vector / max(float(np.linalg.norm(vector)), 1e-9)).tolist())
        return out


@dataclasses.dataclass
class Loader:
    """Loads a ``WordsModel`` per embedder name and counts the loads."""

    models: dict[str, WordsModel] = dataclasses.field(default_factory=dict)
    loads: list[str] = dataclasses.field(default_factory=list)

    def __call__(self, name: str) -> WordsModel:
        self.loads.append(name)
        return self.models.setdefault(name, WordsModel(seed=len(self.models)))


def text_model(name: str, embedder: str = "embed") -> ModelSpec:
    return dataclasses.replace(ECHO, name=name, cache_text="text", cache_threshold=0.9, cache_embedder=embedder)


@pytest.fixture(params=["memory", "redis"])
async def cache_store(request: pytest.FixtureRequest) -> AsyncIterator[CacheStore]:
    if request.param == "memory":
        yield MemoryCacheStore()
        return
    store = RedisStore(request.getfixturevalue("redis_url"), job_ttl_s=60)
    await store.connect()
    try:
        yield RedisCacheStore(store.redis, store.display_url)
    finally:
        await store.close()


def three_models(unique: str) -> dict[str, ModelSpec]:
    """Two models keyed by ``embed`` and one by another embedder ``mini``."""
    return {
        f"a-{unique}": text_model(f"a-{unique}"),
        f"b-{unique}": text_model(f"b-{unique}"),
        f"c-{unique}": text_model(f"c-{unique}", embedder="mini"),
    }


def l3_cache(specs: dict[str, ModelSpec], store: CacheStore, loader: Loader) -> ResultCache:
    settings = FleetSettings(cache=",".join(f"{name}=l1+l2+l3" for name in specs), cache_l3_sync_interval_s=60)
    cache = build_cache(settings, specs, store, loader)
    assert cache is not None
    return cache


def succeeded(model: str, output: object) -> JobRecord:
    return JobRecord(job_id="j", model=model, state=JobState.succeeded, output=output)


async def test_each_distinct_embedder_is_loaded_once(cache_store: CacheStore, unique: str) -> None:
    loader = Loader()
    cache = l3_cache(three_models(unique), cache_store, loader)
    assert cache.embedders is not None
    assert sorted(cache.embedders.by_name) == ["embed", "mini"]
    await cache.start()
    try:
        await cache.embedders.warm()
        assert sorted(loader.loads) == ["embed", "mini"]  # three models, two embedders, two loads
        assert cache.embedder(f"a-{unique}") is cache.embedder(f"b-{unique}")
        assert cache.embedder(f"a-{unique}") is not cache.embedder(f"c-{unique}")
    finally:
        await cache.stop()


async def test_a_models_l3_is_keyed_by_its_own_embedder(cache_store: CacheStore, unique: str) -> None:
    loader = Loader()
    specs = three_models(unique)
    cache = l3_cache(specs, cache_store, loader)
    await cache.start()
    try:
        assert cache.embedders is not None
        await cache.embedders.warm()
        asked = {f"a-{unique}": "my bank account", f"c-{unique}": "my credit card"}
        for name, thing in asked.items():
            spec = specs[name]
            found = await cache.lookup(spec, {"text": f"Please help me open {thing}."})
            assert found.hit is None
            await cache.fill(found, succeeded(name, {"answer": name}))
            hit = (await cache.lookup(spec, {"text": f"please HELP me open {thing}", "n": 2})).hit
            assert hit is not None and hit.level == "l3" and hit.output == {"answer": name}
        embedded = {name: model.texts for name, model in loader.models.items()}
        assert embedded["embed"] and all("bank" in text for text in embedded["embed"])  # a's texts only
        assert embedded["mini"] and all("credit" in text for text in embedded["mini"])  # c's texts only
    finally:
        await cache.stop()


def test_an_embedder_the_gateway_cannot_load_is_refused_at_start_up_naming_model_and_embedder() -> None:
    spec = text_model("extract", embedder="minilm-typo")
    settings = FleetSettings(cache="extract=l1+l2+l3")
    with pytest.raises(ConfigError, match=r"model 'extract' .* embedder 'minilm-typo' .*known embedders: embed"):
        build_cache(settings, {"extract": spec}, MemoryCacheStore())


def test_only_models_with_l3_need_a_known_embedder() -> None:
    spec = text_model("extract", embedder="minilm-typo")
    cache = build_cache(FleetSettings(cache="extract=l1+l2"), {"extract": spec}, MemoryCacheStore())
    assert cache is not None and cache.embedders is None and cache.embedder("extract") is None


def test_check_embedders_and_load_embedder_refuse_an_unknown_name() -> None:
    check_embedders({"m": text_model("m")})
    assert set(EMBEDDERS) == {"embed"}
    with pytest.raises(ConfigError, match=r"'nope' is not an L3 embedder; known: embed"):
        load_embedder("cpu", "nope")


def manifest_entry(tmp_path: Path, cache: dict[str, object]) -> RepositoryEntry:
    manifest = ModelManifest.model_validate({"runtime": "token-classification", "cache": cache})
    return RepositoryEntry("extract", "1", tmp_path, tmp_path, manifest)


def test_the_manifest_names_the_embedder_and_spec_for_passes_it_through(tmp_path: Path) -> None:
    spec = spec_for(manifest_entry(tmp_path, {"text": "text", "embedder": "embed", "threshold": 0.93}))
    assert (spec.cache_text, spec.cache_embedder, spec.cache_threshold) == ("text", "embed", 0.93)
    assert spec_for(manifest_entry(tmp_path, {"text": "text"})).cache_embedder == "embed"  # the default
    other = spec_for(manifest_entry(tmp_path, {"text": "text", "embedder": "mini"}))
    settings = FleetSettings(cache="extract")
    with pytest.raises(ConfigError, match="embedder 'mini'"):
        build_cache(settings, {"extract": other}, MemoryCacheStore())


@pytest.mark.services
def test_a_gateway_process_refuses_the_unknown_embedder_at_start_up(nats_url: str, redis_url: str) -> None:
    env = {
        "FLEET_BROKER_URL": nats_url,
        "FLEET_STORE_URL": redis_url,
        "FLEET_MODELS": "tests.test_cache_embedders:EXTRACT_TYPO",
        "FLEET_CACHE": "extract-typo",
    }
    result = run_fleet("gateway", "--port", "0", env=env, timeout_s=90)
    assert result.returncode != 0 and "the gateway could not start" in result.stderr, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error:")]  # one line that says why
    assert "the embedder 'minilm-typo'" in line and "see the log" not in line, line
    named = "ConfigError: cache: model 'extract-typo' keys its l3 cache with the embedder 'minilm-typo'"
    assert named in " ".join(result.stdout.split()), result.stdout[-3000:]  # the log says why


class ThreadsModel:
    """Records the torch thread count and thread name each batch ran with."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, str]] = []

    def embed_texts(self, texts: list[str]) -> list[list[float]]:
        self.seen.append((torch.get_num_threads(), threading.current_thread().name))
        return [[1.0] + [0.0] * (EMBED_DIM - 1) for _ in texts]


async def test_the_embedder_runs_in_its_own_thread_with_its_torch_threads_and_leaves_other_threads_theirs() -> None:
    assert FleetSettings().cache_embedder_threads == 1
    process = torch.get_num_threads()
    wanted = 1 if process > 1 else 2
    model = ThreadsModel()
    embedder = BatchingEmbedder(lambda: model, threads=wanted)
    try:
        vectors = await asyncio.gather(*(embedder.embed(f"text {i}") for i in range(5)))
        await embedder.embed("one more")
    finally:
        embedder.close()
    assert len(vectors) == 5 and all(v.shape == (EMBED_DIM,) for v in vectors)
    assert model.seen and all(count == wanted and name.startswith("l3-embedder") for count, name in model.seen)
    fresh: list[int] = []  # a thread started afterwards (a worker's model thread under `fleet up`)
    thread = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert fresh == [process] and torch.get_num_threads() == process


@pytest.mark.parametrize("value", ["0", "-1", "1025", "two", "1.5", "9" * 400])
def test_a_bad_embedder_thread_count_is_refused_naming_the_setting(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("FLEET_CACHE_EMBEDDER_THREADS", value)
    with pytest.raises(ValidationError, match="cache_embedder_threads"):
        FleetSettings()
