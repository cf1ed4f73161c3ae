"""Tiny seeded transformers models of each runtime's kind, saved with safetensors into a repository folder.

``build_tiny(kind, folder)`` writes a BERT (or, with ``arch="deberta-v2"``, a DeBERTa-v2) of hidden size 32 and 2
layers (seeded random weights, so the same seed gives the same model) with a small WordPiece vocabulary;
``add_entry(repo, name, kind)`` builds one as ``repo/<name>/<version>/`` with a ``model.yaml`` listing the sha256 of
every file, and returns its ``RepositoryEntry``. Their outputs mean nothing; their shapes, spans, orderings and
arithmetic are the real ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from fleet.repository.entry import RepositoryEntry
from fleet.repository.verify import sha256_of
from fleet.schemas.manifest import MANIFEST_FILE, ModelManifest

KINDS = ("embeddings", "classification", "multi-label", "token-classification", "rerank")
RUNTIME_OF = {"multi-label": "classification"}
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = (
    "the a an of in on to and is was lived ada lovelace london paris fleet serves models model query passage "
    "what where who cat dog sat mat runs park quick brown fox jumps over lazy good bad great movie film ok "
    "short sentence warm up text . , ! ?"
).split()
LETTERS = list("abcdefghijklmnopqrstuvwxyz0123456789")
VOCAB = [*SPECIAL, *WORDS, *LETTERS, *(f"##{c}" for c in LETTERS), "##ing", "##ed", "##s", "##on", "##don"]
NER_LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
SENTIMENT = ["negative", "neutral", "positive"]
TOPICS = ["sport", "politics", "science", "art"]
SHAPE: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
    "initializer_range": 0.4,  # spread-out scores, so argmaxes do not hang on float noise
}


def write_tokenizer(folder: Path) -> None:
    """A lower-casing WordPiece tokenizer over ``VOCAB`` (vocab.txt, tokenizer.json and their configs)."""
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(VOCAB) + "\n")
    BertTokenizerFast(vocab_file=str(vocab), do_lower_case=True, model_max_length=128).save_pretrained(str(folder))


ARCHS = ("bert", "deberta-v2")


def tiny_config(arch: str) -> Any:
    """The config of a tiny ``arch`` model: BERT, or DeBERTa-v2 (the architecture of the seeds' RexUniNLU)."""
    from transformers import BertConfig, DebertaV2Config

    if arch == "bert":
        return BertConfig(vocab_size=len(VOCAB), **SHAPE)
    if arch == "deberta-v2":
        return DebertaV2Config(
            vocab_size=len(VOCAB), relative_attention=True, position_buckets=16, pos_att_type=["p2c", "c2p"], **SHAPE
        )
    raise ValueError(f"unknown arch {arch!r}; known: {', '.join(ARCHS)}")


def build_tiny(kind: str, folder: Path, *, seed: int = 0, arch: str = "bert") -> Path:
    """Write a tiny ``arch`` model of ``kind`` (one of ``KINDS``) and its tokenizer into ``folder``; return
    ``folder``."""
    import torch
    from transformers import (
        AutoModel,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    config = tiny_config(arch)
    if kind == "embeddings":
        model_cls: Any = AutoModel
    elif kind in ("classification", "multi-label"):
        labels = SENTIMENT if kind == "classification" else TOPICS
        config.num_labels = len(labels)
        config.id2label = dict(enumerate(labels))
        config.label2id = {v: k for k, v in enumerate(labels)}
        if kind == "multi-label":
            config.problem_type = "multi_label_classification"
        model_cls = AutoModelForSequenceClassification
    elif kind == "token-classification":
        config.num_labels = len(NER_LABELS)
        config.id2label = dict(enumerate(NER_LABELS))
        config.label2id = {v: k for k, v in enumerate(NER_LABELS)}
        model_cls = AutoModelForTokenClassification
    elif kind == "rerank":
        config.num_labels = 1
        model_cls = AutoModelForSequenceClassification
    else:
        raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls.from_config(config).eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    write_tokenizer(folder)
    return folder


def digests(folder: Path) -> dict[str, str]:
    """The sha256 of every file under ``folder`` but ``model.yaml``, by relative path."""
    return {
        p.relative_to(folder).as_posix(): sha256_of(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST_FILE
    }


def write_manifest(folder: Path, runtime: str, **fields: Any) -> ModelManifest:
    """Write ``folder/model.yaml`` for the weights in ``folder`` (every file with its sha256) and return it."""
    data: dict[str, Any] = {"runtime": runtime, **fields}
    data.setdefault("weights", {})["files"] = digests(folder)
    manifest = ModelManifest.model_validate(data)
    (folder / MANIFEST_FILE).write_text(yaml.safe_dump(manifest.model_dump(mode="json", exclude_defaults=True)))
    return manifest


def read_entry(repo: Path, name: str, version: str = "1") -> RepositoryEntry:
    folder = repo / name / version
    manifest = ModelManifest.model_validate(yaml.safe_load((folder / MANIFEST_FILE).read_text()))
    return RepositoryEntry(name, version, folder, folder, manifest)


def add_entry(
    repo: Path, name: str, kind: str, *, version: str = "1", seed: int = 0, arch: str = "bert", **fields: Any
) -> RepositoryEntry:
    """Build a tiny model of ``kind`` as ``repo/<name>/<version>/`` with its ``model.yaml``; its entry."""
    folder = build_tiny(kind, repo / name / version, seed=seed, arch=arch)
    write_manifest(folder, RUNTIME_OF.get(kind, kind), **fields)
    return read_entry(repo, name, version)
