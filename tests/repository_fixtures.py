"""Builders for the model repository's tests: tiny transformers models saved as safetensors (hidden size 32, 2
layers, seeded), a WordPiece tokenizer from a small vocabulary written here, a hand-written repository entry served
by a test handler class (``runtime: handler``), and an ed25519 key pair.

The runtimes' own tiny-model builders live in ``tests/tiny_models.py`` on the runtimes branch; these are what the
repository needs until both are merged.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

from fleet.consumers.handlers.base import ModelHandler
from fleet.schemas.models import ModelSpec

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz", "good", "bad", "movie", "the"]
LABELS = {0: "negative", 1: "positive"}


def tiny_config(**overrides: Any) -> Any:
    from transformers import BertConfig

    base = dict(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return BertConfig(**{**base, **overrides})


def tiny_model(folder: Path, kind: str = "classification", num_labels: int = 2) -> Path:
    """Save a tiny BERT of ``kind`` (classification, token-classification, encoder) and its tokenizer."""
    import torch
    from transformers import BertForSequenceClassification, BertForTokenClassification, BertModel, BertTokenizerFast

    torch.manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    labels = {i: f"label_{i}" for i in range(num_labels)} if num_labels != 2 else LABELS
    config = tiny_config(id2label=labels, label2id={v: k for k, v in labels.items()})
    cls = {
        "classification": BertForSequenceClassification,
        "token-classification": BertForTokenClassification,
        "encoder": BertModel,
    }[kind]
    cls(config).save_pretrained(folder, safe_serialization=True)
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(VOCAB) + "\n")
    BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(folder)
    return folder


class ItemIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str


class ItemOut(BaseModel):
    text: str
    weights_bytes: int


class ReadsWeights(ModelHandler[ItemIn, ItemOut]):
    """A user's handler served from a repository entry (``runtime: handler``): it reads its entry's one weight file
    in ``load`` (after the entry's files were verified) and answers the text upper-cased with the file's size."""

    spec = ModelSpec("reads-weights", ItemIn, ItemOut, max_batch=8)
    entry: Any = None

    def load(self) -> None:
        self.size = (self.entry.weights_dir / "weights.safetensors").stat().st_size

    def predict(self, batch: list[ItemIn]) -> list[ItemOut | Exception]:
        return [ItemOut(text=i.text.upper(), weights_bytes=self.size) for i in batch]


HANDLER_REF = "tests.repository_fixtures:ReadsWeights"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def handler_entry(root: Path, name: str, version: str, payload: bytes = b"weights", **fields: Any) -> Path:
    """Write ``root/name/version`` by hand: one weight file and a ``runtime: handler`` model.yaml listing it."""
    folder = root / name / version
    folder.mkdir(parents=True)
    (folder / "weights.safetensors").write_bytes(payload)
    manifest = {
        "runtime": "handler",
        "handler": HANDLER_REF,
        "description": f"{name} {version}",
        "weights": {"files": {"weights.safetensors": sha256(payload)}},
        **fields,
    }
    (folder / "model.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    return folder


def key_pair(folder: Path) -> tuple[Path, Path]:
    """``(private PEM, public PEM)`` files of a new ed25519 key."""
    from fleet.repository.signing import generate_key_pair

    private, public = generate_key_pair()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "signing.pem").write_bytes(private)
    (folder / "signing.pem.pub").write_bytes(public)
    return folder / "signing.pem", folder / "signing.pem.pub"
