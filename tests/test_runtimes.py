"""The task runtimes on tiny seeded models: each against a bare transformers computation on the same model, and the
load's refusals (tampered, unlisted or pickled files, bad options)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from fleet.consumers.runtimes import RUNTIME_CLASSES, runtime_handler
from fleet.consumers.runtimes.entities import Piece, Tagged, entities, grouped, tag_of, word_tag, words
from fleet.consumers.runtimes.passes import estimate_tokens, flatten, job_slices, sorted_passes, split_back
from fleet.encoding import decode_vector
from fleet.errors import ConfigError, InvalidInput
from fleet.repository.entry import RepositoryEntry
from fleet.schemas.manifest import ModelManifest
from fleet.schemas.runtimes import (
    ClassificationInput,
    ClassificationOutput,
    EmbeddingsInput,
    EmbeddingsOutput,
    RerankInput,
    RerankOutput,
    TokenClassificationInput,
    TokenClassificationOutput,
)
from tests.tiny_models import NER_LABELS, SENTIMENT, TOPICS, add_entry, build_tiny, read_entry, write_manifest

TEXTS = [
    "Ada Lovelace lived in London.",
    "the quick brown fox jumps over the lazy dog in paris",
    "Lovelaces walking ok!",
    "",
    "xyzzy fleet " * 30,
]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    add_entry(root, "vec", "embeddings", options={"dimensions": [8, 16]})
    add_entry(root, "vec-cls", "embeddings", seed=0, options={"pooling": "cls", "normalize": False})
    add_entry(root, "sentiment", "classification")
    add_entry(root, "topics", "multi-label", options={"top_k": 0})
    add_entry(root, "ner", "token-classification")
    add_entry(root, "ranker", "rerank")
    return root


def loaded(repo: Path, name: str, **options: Any) -> Any:
    handler = runtime_handler(read_entry(repo, name))(device="cpu", **options)
    handler.load()
    handler.warmup()
    return handler


@pytest.fixture(scope="module")
def handlers(repo: Path) -> Iterator[dict[str, Any]]:
    made = {name: loaded(repo, name) for name in ("vec", "vec-cls", "sentiment", "topics", "ner", "ranker")}
    yield made
    for handler in made.values():
        handler.close()


def bare(folder: Path, auto: str) -> tuple[Any, Any]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = getattr(transformers, auto).from_pretrained(str(folder), use_safetensors=True).eval()
    return tokenizer, model


def token_count(folder: Path, texts: list[str], pairs: list[str] | None = None) -> int:
    tokenizer, _ = bare(folder, "AutoModel")
    return sum(len(ids) for ids in tokenizer(texts, pairs, truncation=True)["input_ids"])


# -- the shared passes (pure) ---------------------------------------------------------------------------------
def test_passes_sort_by_length_fit_the_budget_and_split_back_in_order() -> None:
    ids = [[1] * n for n in (3, 50, 7, 50, 1, 20)]
    passes = list(sorted_passes(ids, 100))
    assert sorted(i for rows in passes for i in rows) == list(range(6)), "every row once"
    assert all(len(rows) * max(len(ids[i]) for i in rows) <= 100 for rows in passes if len(rows) > 1)
    assert passes[0] == [1, 3], "the longest rows share the first pass"
    flat, counts = flatten([["a"], ["b", "c"], [], ["d"]])
    assert flat == ["a", "b", "c", "d"] and counts == [1, 2, 0, 1]
    assert split_back(flat, counts) == [["a"], ["b", "c"], [], ["d"]]
    assert job_slices([2, 1]) == [slice(0, 2), slice(2, 3)]


def test_entity_grouping_follows_the_tags() -> None:
    def t(label: str, start: int, end: int, score: float = 0.5) -> Tagged:
        return Tagged(label, score, start, end)

    assert tag_of("B-PER") == ("B", "PER") and tag_of("I-LOC") == ("I", "LOC") and tag_of("MISC") == ("I", "MISC")
    items = [t("B-PER", 0, 3, 0.9), t("I-PER", 4, 12, 0.7), t("B-PER", 13, 16), t("I-LOC", 17, 20), t("O", 21, 22)]
    assert [(g.label, g.start, g.end) for g in grouped(items)] == [
        ("PER", 0, 12),  # B then I of one type: one entity
        ("PER", 13, 16),  # a new B starts another
        ("LOC", 17, 20),  # I of another type starts another too
        ("O", 21, 22),
    ]
    assert grouped(items)[0].score == pytest.approx(0.8)
    pieces = [Piece(0, 3, [0.1, 0.9], False), Piece(3, 5, [0.8, 0.2], True), Piece(6, 8, [0.6, 0.4], False)]
    assert [len(w) for w in words(pieces)] == [2, 1]
    word = words(pieces)[0]
    assert word_tag(word, ["O", "B-PER"], "first").label == "B-PER"
    assert word_tag(word, ["O", "B-PER"], "max").label == "B-PER"  # 0.9 is the most confident piece
    assert word_tag(word, ["O", "B-PER"], "average").score == pytest.approx(0.55)
    text = "Ada Lovelace"
    found = entities(text, pieces, ["O", "B-PER"], "simple", ["O"])
    assert [(e.label, e.text) for e in found] == [("PER", "Ada")]


# -- embeddings -----------------------------------------------------------------------------------------------
def bare_embeddings(folder: Path, texts: list[str], pooling: str = "mean", normalize: bool = True) -> np.ndarray:
    tokenizer, model = bare(folder, "AutoModel")
    enc = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**enc).last_hidden_state
    if pooling == "cls":
        vectors = hidden[:, 0]
    else:
        mask = enc["attention_mask"].unsqueeze(-1).float()
        vectors = (hidden * mask).sum(1) / mask.sum(1)
    if normalize:
        vectors = torch.nn.functional.normalize(vectors, dim=1)
    result: np.ndarray = vectors.numpy()
    return result


def test_embeddings_match_bare_transformers_with_mean_and_cls_pooling(handlers: dict[str, Any], repo: Path) -> None:
    vec = handlers["vec"]
    out = vec.run([EmbeddingsInput(texts=TEXTS), EmbeddingsInput(text="ok")])
    assert [type(o) for o in out] == [EmbeddingsOutput, EmbeddingsOutput]
    many = np.asarray(vec.output_json(out[0])["embeddings"])
    assert many.shape == (len(TEXTS), 32) and vec.output_json(out[0])["dim"] == 32
    np.testing.assert_allclose(many, bare_embeddings(repo / "vec" / "1", TEXTS), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(many, axis=1), 1, atol=1e-5)
    one = vec.output_json(out[1])
    assert one["embeddings"] is None and len(one["embedding"]) == 32
    cls = handlers["vec-cls"]
    raw = np.asarray(cls.output_json(cls.run([EmbeddingsInput(texts=TEXTS)])[0])["embeddings"])
    np.testing.assert_allclose(raw, bare_embeddings(repo / "vec-cls" / "1", TEXTS, "cls", False), atol=1e-5)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1), "normalize: false leaves the norms"


def test_embeddings_count_tokens_and_encode_base64(handlers: dict[str, Any], repo: Path) -> None:
    vec = handlers["vec"]
    out = vec.run([EmbeddingsInput(texts=TEXTS[:3]), EmbeddingsInput(text=TEXTS[3])])
    assert out[0].tokens == token_count(repo / "vec" / "1", TEXTS[:3]) and out[1].tokens == 2
    packed = vec.output_json(out[0], "base64")
    floats = vec.output_json(out[0])
    assert [decode_vector(v) for v in packed["embeddings"]] == floats["embeddings"]


def test_matryoshka_dimensions_truncate_and_renormalise_and_refuse_undeclared_sizes(handlers: dict[str, Any]) -> None:
    vec = handlers["vec"]
    full, eight, bad, sixteen = vec.run(
        [
            EmbeddingsInput(texts=TEXTS[:2]),
            EmbeddingsInput(texts=TEXTS[:2], dimensions=8),
            EmbeddingsInput(text="x", dimensions=12),
            EmbeddingsInput(text=TEXTS[0], dimensions=16),
        ]
    )
    assert isinstance(bad, InvalidInput) and bad.errors[0]["loc"] == ["dimensions"]  # the caller's mistake: a 4xx
    assert "dimensions=12" in str(bad) and "8, 16, 32" in str(bad)
    cut = np.asarray(vec.output_json(eight)["embeddings"])
    assert eight.dim == 8 and cut.shape == (2, 8)
    wanted = np.asarray(vec.output_json(full)["embeddings"])[:, :8]
    np.testing.assert_allclose(cut, wanted / np.linalg.norm(wanted, axis=1, keepdims=True), atol=1e-6)
    assert sixteen.dim == 16 and len(vec.output_json(sixteen)["embedding"]) == 16
    assert vec.run([EmbeddingsInput(text="x", dimensions=32)])[0].dim == 32, "the full size is always taken"


def test_dtype_and_device_come_from_the_manifest(tmp_path: Path) -> None:
    entry = add_entry(tmp_path, "half", "embeddings", dtype="bfloat16", device="cpu")
    handler = runtime_handler(entry)(device="auto")
    handler.load()
    assert handler.device == "cpu" and handler.model.dtype == torch.bfloat16
    vector = np.asarray(handler.output_json(handler.run([EmbeddingsInput(text="a cat")])[0])["embedding"])
    assert vector.dtype == np.float64 and abs(np.linalg.norm(vector) - 1) < 1e-5, "pooled in fp32, whatever the model"


def test_a_batch_gives_what_single_jobs_give_whatever_the_forward_budget(repo: Path) -> None:
    small = loaded(repo, "vec", max_tokens_per_forward=16)
    big = loaded(repo, "vec")
    jobs = [EmbeddingsInput(text=t) for t in TEXTS]
    batched = np.asarray([small.output_json(o)["embedding"] for o in small.run(jobs)])
    single = np.asarray([big.output_json(big.run([j])[0])["embedding"] for j in jobs])
    np.testing.assert_allclose(batched, single, atol=1e-5)


# -- classification -------------------------------------------------------------------------------------------
def bare_logits(folder: Path, texts: list[str], pairs: list[str] | None = None) -> torch.Tensor:
    tokenizer, model = bare(folder, "AutoModelForSequenceClassification")
    with torch.inference_mode():
        logits: torch.Tensor = model(
            **tokenizer(texts, pairs, padding=True, truncation=True, return_tensors="pt")
        ).logits
    return logits


def test_classification_answers_softmax_labels_best_first_with_top_k(handlers: dict[str, Any], repo: Path) -> None:
    sentiment = handlers["sentiment"]
    default, every, two, one = sentiment.run(
        [
            ClassificationInput(texts=TEXTS),
            ClassificationInput(texts=TEXTS, top_k=0),
            ClassificationInput(texts=TEXTS, top_k=2),
            ClassificationInput(text=TEXTS[0]),
        ]
    )
    probs = torch.softmax(bare_logits(repo / "sentiment" / "1", TEXTS), dim=-1)
    assert all(len(r) == 1 for r in default.results) and all(len(r) == 2 for r in two.results)
    for row, labels in zip(probs.tolist(), every.results, strict=True):
        assert sorted(x.label for x in labels) == sorted(SENTIMENT)
        assert [x.score for x in labels] == sorted((x.score for x in labels), reverse=True)
        assert {x.label: x.score for x in labels} == pytest.approx(dict(zip(SENTIMENT, row, strict=True)), abs=1e-5)
        assert sum(x.score for x in labels) == pytest.approx(1, abs=1e-5)
    assert one.results is None and one.labels == every.results[0][:1]
    assert every.tokens == token_count(repo / "sentiment" / "1", TEXTS)
    assert ClassificationOutput.model_validate(sentiment.output_json(every)) is not None


def test_multi_label_scores_are_independent_sigmoids(handlers: dict[str, Any], repo: Path) -> None:
    topics = handlers["topics"]
    assert topics.multi_label, "from config.json's problem_type"
    out = topics.run([ClassificationInput(texts=TEXTS)])[0]
    sig = torch.sigmoid(bare_logits(repo / "topics" / "1", TEXTS))
    for row, labels in zip(sig.tolist(), out.results, strict=True):
        assert len(labels) == len(TOPICS), "options.top_k: 0 gives every label"
        assert {x.label: x.score for x in labels} == pytest.approx(dict(zip(TOPICS, row, strict=True)), abs=1e-5)
    assert any(abs(sum(x.score for x in labels) - 1) > 0.05 for labels in out.results)


def test_multi_label_can_be_forced_by_the_manifest(tmp_path: Path) -> None:
    entry = add_entry(tmp_path, "forced", "classification", options={"multi_label": True, "top_k": 0})
    handler = runtime_handler(entry)(device="cpu")
    handler.load()
    labels = handler.run([ClassificationInput(text="good film")])[0].labels
    sig = torch.sigmoid(bare_logits(entry.folder, ["good film"]))[0].tolist()
    assert {x.label: x.score for x in labels} == pytest.approx(dict(zip(SENTIMENT, sig, strict=True)), abs=1e-5)


# -- token classification -------------------------------------------------------------------------------------
@pytest.mark.parametrize("aggregation", ["none", "simple", "first", "max", "average"])
def test_entities_are_the_pipelines_with_spans_into_the_text(
    handlers: dict[str, Any], repo: Path, aggregation: str
) -> None:
    from transformers import pipeline

    ner = handlers["ner"]
    tokenizer, model = bare(repo / "ner" / "1", "AutoModelForTokenClassification")
    reference = pipeline("token-classification", model=model, tokenizer=tokenizer, aggregation_strategy=aggregation)
    out = ner.run([TokenClassificationInput(texts=TEXTS, aggregation=aggregation)])[0]
    assert isinstance(out, TokenClassificationOutput)
    for text, found in zip(TEXTS, out.results, strict=True):
        theirs = [
            (r.get("entity_group", r.get("entity")), r["start"], r["end"], pytest.approx(float(r["score"]), abs=1e-5))
            for r in reference(text)
        ]
        assert [(e.label, e.start, e.end, e.score) for e in found] == theirs
        assert all(e.text == text[e.start : e.end] and e.text.strip() for e in found)
    labels = {e.label for found in out.results for e in found}
    assert labels and labels <= (set(NER_LABELS) if aggregation == "none" else {"PER", "LOC"}), labels
    one = ner.run([TokenClassificationInput(text=TEXTS[0], aggregation=aggregation)])[0]
    for output in (out, one):  # the written-out JSON is pydantic's dump, field for field
        assert ner.output_json(output) == output.model_dump(mode="json")


def test_token_classification_on_a_deberta_v2_model_is_the_pipelines(tmp_path: Path) -> None:
    from transformers import pipeline

    entry = add_entry(tmp_path, "extract", "token-classification", arch="deberta-v2", options={"aggregation": "none"})
    handler = runtime_handler(entry)(device="cpu")
    handler.load()
    assert handler.model.config.model_type == "deberta-v2"
    tokenizer, model = bare(entry.folder, "AutoModelForTokenClassification")
    reference = pipeline("token-classification", model=model, tokenizer=tokenizer, aggregation_strategy="none")
    for text, found in zip(TEXTS, handler.run([TokenClassificationInput(texts=TEXTS)])[0].results, strict=True):
        assert [(e.label, e.start, e.end) for e in found] == [
            (r["entity"], r["start"], r["end"]) for r in reference(text)
        ]


def test_ignore_labels_and_the_default_aggregation_come_from_the_manifest(tmp_path: Path) -> None:
    entry = add_entry(tmp_path, "tags", "token-classification", options={"aggregation": "none", "ignore_labels": []})
    handler = runtime_handler(entry)(device="cpu")
    handler.load()
    out = handler.run([TokenClassificationInput(text="Ada lived in London")])[0]
    tokenizer, _ = bare(entry.folder, "AutoModel")
    assert len(out.entities) == len(tokenizer("Ada lived in London")["input_ids"]) - 2, "every real token, O too"
    assert out.tokens == len(tokenizer("Ada lived in London")["input_ids"])


@pytest.mark.parametrize("arch", ["bert", "deberta-v2"])
def test_a_prompt_is_read_before_each_text_and_never_tagged(tmp_path: Path, arch: str) -> None:
    """``options.prompt`` (a zero-shot extractor's schema): the model reads ``prompt`` then the text as a pair; the
    entities are the text's tokens only, scored as the bare model scores them in that pair, spans into the text."""
    prompt = "[schema] person, location"
    options = {"aggregation": "none", "ignore_labels": [], "prompt": prompt, "max_seq_tokens": 24}
    entry = add_entry(tmp_path, "schema", "token-classification", arch=arch, options=options)
    handler = runtime_handler(entry)(device="cpu")
    handler.load()
    tokenizer, model = bare(entry.folder, "AutoModelForTokenClassification")
    texts = ["Ada Lovelace lived in London.", "ok", "lovelace " * 40]
    out = handler.run([TokenClassificationInput(texts=texts)])[0]
    for text, found in zip(texts, out.results, strict=True):
        enc = tokenizer(prompt, text, truncation="only_second", max_length=24, return_offsets_mapping=True)
        with torch.inference_mode():
            probs = model(**tokenizer(prompt, text, truncation="only_second", max_length=24, return_tensors="pt"))
        scores = torch.softmax(probs.logits[0], dim=-1)
        theirs = [
            (NER_LABELS[int(scores[j].argmax())], *enc["offset_mapping"][j], pytest.approx(float(scores[j].max())))
            for j, segment in enumerate(enc.sequence_ids())
            if segment == 1
        ]
        assert [(e.label, e.start, e.end, e.score) for e in found] == theirs
        assert all(e.text == text[e.start : e.end] for e in found)
    long_text = out.results[2]
    assert 0 < len(long_text) < 40 and long_text[-1].end < len(texts[2]), "the text is truncated, not the prompt"
    pairs = [tokenizer(prompt, t, truncation="only_second", max_length=24)["input_ids"] for t in texts]
    assert out.tokens == sum(len(ids) for ids in pairs)
    prompt_tokens = len(tokenizer(prompt, "a")["input_ids"]) - len(tokenizer("a")["input_ids"])
    assert handler.prompt_tokens == prompt_tokens == len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) + 1
    estimates = [min(24, prompt_tokens + estimate_tokens(len(t), 24)) for t in texts]
    assert handler.cost(TokenClassificationInput(texts=texts)) == sum(estimates) and estimates[2] == 24


def test_a_prompt_that_leaves_the_text_no_room_is_refused_at_load(tmp_path: Path) -> None:
    options = {"prompt": "person location " * 10, "max_seq_tokens": 16}
    entry = add_entry(tmp_path, "crowded", "token-classification", options=options)
    with pytest.raises(ConfigError, match=r"options.prompt takes 21 tokens, leaving none of the 16 the model reads"):
        runtime_handler(entry)(device="cpu").load()


# -- rerank ---------------------------------------------------------------------------------------------------
def test_rerank_sorts_by_the_cross_encoders_sigmoid_with_top_n_and_text(handlers: dict[str, Any], repo: Path) -> None:
    ranker = handlers["ranker"]
    query = "where did ada live"
    every, best, texts = ranker.run(
        [
            RerankInput(query=query, texts=TEXTS),
            RerankInput(query=query, texts=TEXTS, top_n=2),
            RerankInput(query=query, texts=TEXTS[:3], return_text=True),
        ]
    )
    scores = torch.sigmoid(bare_logits(repo / "ranker" / "1", [query] * len(TEXTS), TEXTS)[:, 0]).tolist()
    assert isinstance(every, RerankOutput)
    assert sorted(r.index for r in every.results) == list(range(len(TEXTS)))
    assert [r.index for r in every.results] == sorted(range(len(TEXTS)), key=lambda i: -scores[i])
    for r in every.results:
        assert r.score == pytest.approx(scores[r.index], abs=1e-5) and r.text is None
    assert best.results == every.results[:2]
    assert all(r.text == TEXTS[r.index] for r in texts.results)
    assert every.tokens == token_count(repo / "ranker" / "1", [query] * len(TEXTS), TEXTS)


def test_rerank_refuses_a_model_with_more_than_one_output(tmp_path: Path) -> None:
    folder = build_tiny("classification", tmp_path / "three" / "1")
    write_manifest(folder, "rerank")
    with pytest.raises(ConfigError, match="num_labels: 1"):
        runtime_handler(read_entry(tmp_path, "three"))(device="cpu").load()


# -- costs ----------------------------------------------------------------------------------------------------
def test_cost_estimates_tokens_without_loading(repo: Path) -> None:
    vec = runtime_handler(read_entry(repo, "vec"))()
    assert vec.model is None
    assert vec.cost(EmbeddingsInput(text="word " * 8)) == 2 + 10
    assert vec.cost(EmbeddingsInput(texts=["x" * 10_000, "ab"])) == 512 + 3, "capped at the default truncation"
    ranker = runtime_handler(read_entry(repo, "ranker"))()
    assert ranker.cost(RerankInput(query="abcd", texts=["abcd", "abcdabcd"])) == (3 + 2) + (3 + 3)
    assert vec.spec.max_batch_cost == 16_384, "a token budget by default"


# -- the load's refusals --------------------------------------------------------------------------------------
def copy_entry(repo: Path, name: str, tmp_path: Path) -> RepositoryEntry:
    shutil.copytree(repo / name, tmp_path / name)
    return read_entry(tmp_path, name)


def test_a_tampered_weight_file_is_refused_naming_it(repo: Path, tmp_path: Path) -> None:
    entry = copy_entry(repo, "sentiment", tmp_path)
    weights = entry.folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"sentiment@1: weight file model\.safetensors does not match") as exc:
        runtime_handler(entry)(device="cpu").load()
    assert "\n" not in str(exc.value)


def test_a_missing_or_unlisted_file_is_refused(repo: Path, tmp_path: Path) -> None:
    entry = copy_entry(repo, "vec", tmp_path)
    (entry.folder / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"tokenizer\.json is missing"):
        runtime_handler(entry)(device="cpu").load()
    entry = copy_entry(repo, "ner", tmp_path / "b")
    (entry.folder / "added_tokens.json").write_text(json.dumps({"evil": 99}))
    with pytest.raises(ConfigError, match=r"added_tokens\.json .* is not listed"):
        runtime_handler(entry)(device="cpu").load()


def test_a_folder_of_pickled_weights_only_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    folder = build_tiny("embeddings", tmp_path / "pickled" / "1")
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")  # what older tools wrote
    (folder / "model.safetensors").unlink()
    write_manifest(folder, "embeddings")
    with pytest.raises(ConfigError, match=r"only pickled weights \(pytorch_model.bin\).*safetensors"):
        runtime_handler(read_entry(tmp_path, "pickled"))(device="cpu").load()


def test_bad_options_and_names_fail_when_the_class_is_made(repo: Path) -> None:
    entry = read_entry(repo, "vec")
    with pytest.raises(ConfigError, match="not allowed"):
        runtime_handler(RepositoryEntry("Bad Name", "1", entry.folder, entry.folder, entry.manifest))
    handler_entry = RepositoryEntry(
        "custom", "1", entry.folder, entry.folder, ModelManifest(runtime="handler", handler="a.b:C")
    )
    with pytest.raises(ConfigError, match=r"served by its handler class a\.b:C"):
        runtime_handler(handler_entry)
    with pytest.raises(ValidationError, match="pooling"):
        ModelManifest(runtime="embeddings", options={"pooling": "max"})
    too_big = entry.manifest.model_copy(update={"options": {"dimensions": [64]}})
    with pytest.raises(ConfigError, match=r"options.dimensions \[64\] exceed the model's size 32"):
        runtime_handler(RepositoryEntry("vec", "1", entry.folder, entry.folder, too_big))(device="cpu").load()


def test_manifest_file_names_cannot_leave_the_weights_folder() -> None:
    digest = "0" * 64
    for name in ("../secret", "/etc/passwd", "a/../../b"):
        with pytest.raises(ValidationError, match="relative path inside the weights folder"):
            ModelManifest(runtime="embeddings", weights={"files": {name: digest}})


def test_oversized_inputs_are_refused_by_the_schemas() -> None:
    with pytest.raises(ValidationError):
        EmbeddingsInput(texts=["a"] * 65)
    with pytest.raises(ValidationError):
        ClassificationInput(text="a" * 20_001)
    with pytest.raises(ValidationError):
        RerankInput(query="q", texts=["a"] * 257)


def test_making_a_runtime_class_imports_neither_torch_nor_transformers(repo: Path) -> None:
    code = (
        "import sys\n"
        "from tests.tiny_models import read_entry\n"
        "from fleet.consumers.runtimes import runtime_handler\n"
        f"handler = runtime_handler(read_entry(__import__('pathlib').Path({str(repo)!r}), 'ner'))()\n"
        "print(handler.cost(handler.sample_input()), [m for m in ('torch', 'transformers') if m in sys.modules])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.split(" ", 1)[1].strip() == "[]"
    assert set(RUNTIME_CLASSES) == {"embeddings", "classification", "token-classification", "rerank"}
