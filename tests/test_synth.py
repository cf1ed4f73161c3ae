"""``fleet models synth``: a seeded random DeBERTa-v2 written as a repository entry whose ``model.yaml`` lists every
file's sha256, says plainly that it is a cost stand-in, and keys its L3 with ``embed``. Built here at test size
(``deberta-v2-tiny``, the same architecture); the base size's shape is checked on its config alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fleet.cli import app as cli_app
from fleet.errors import ConfigError
from fleet.repository.entry import RepositoryEntry, spec_for
from fleet.repository.synth import (
    KINDS,
    REXUNINLU_SCHEMA,
    STAND_IN_LABEL,
    WORDPIECE_VOCAB,
    manifest_for,
    synthesize,
)
from fleet.repository.verify import sha256_of, verify_entry
from fleet.schemas.manifest import MANIFEST_FILE, ModelManifest
from fleet.schemas.models import EMBED
from fleet.schemas.runtimes import TokenClassificationInput


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("repo") / "extract" / "1"
    synthesize("deberta-v2-tiny", "token-classification", folder, seed=5)
    return folder


def entry_of(folder: Path) -> RepositoryEntry:
    manifest = ModelManifest.model_validate(yaml.safe_load((folder / MANIFEST_FILE).read_text()))
    return RepositoryEntry(folder.parent.name, folder.name, folder, folder, manifest)


def test_the_entry_lists_every_file_with_its_digest_and_verifies(built: Path) -> None:
    entry = entry_of(built)
    files = sorted(p.name for p in built.iterdir() if p.name != MANIFEST_FILE)
    assert sorted(entry.manifest.weights.files) == files
    assert "model.safetensors" in files and not any(f.endswith((".bin", ".pt", ".pkl")) for f in files)
    for name, digest in entry.manifest.weights.files.items():
        assert sha256_of(built / name) == digest
    verify_entry(entry)


def test_the_manifest_says_it_is_a_stand_in_and_keys_l3_with_embed(built: Path) -> None:
    manifest = entry_of(built).manifest
    assert manifest.runtime == manifest.task == "token-classification"
    assert "COST STAND-IN" in manifest.description and "meaningless" in manifest.description
    assert "WordPiece of all-MiniLM-L6-v2" in manifest.description
    assert manifest.labels["tokenizer"].startswith("all-MiniLM-L6-v2 WordPiece (vocab 30522)")
    assert (manifest.cache.text, manifest.cache.embedder, manifest.cache.threshold) == (
        "text",
        "embed",
        EMBED.cache_threshold,
    )
    spec = spec_for(entry_of(built))
    assert spec.name == "extract" and spec.input_model is TokenClassificationInput
    assert (spec.cache_text, spec.cache_embedder) == ("text", "embed")


def test_the_base_kind_is_deberta_v2_base_shaped_and_labelled_as_rexuninlus_cost() -> None:
    kind = KINDS["deberta-v2-base"]
    shape = {k: kind.config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads")}
    assert shape == {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12}
    assert kind.config["intermediate_size"] == 3072 and kind.config["relative_attention"] is True
    assert kind.config["position_buckets"] == 256 and kind.config["pos_att_type"] == ["p2c", "c2p"]
    manifest = manifest_for(kind, "token-classification", 0, {})
    assert manifest.labels["stand-in"] == STAND_IN_LABEL == "cost of RexUniNLU, outputs meaningless"
    # RexUniNLU reads its schema before each text: the stand-in reads one of 32 tokens (about 44 with a request)
    assert manifest.options == {"prompt": REXUNINLU_SCHEMA} and "reads a schema" in manifest.description
    from transformers import AutoTokenizer

    from fleet.repository.synth import tokenizer_source

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_source()), local_files_only=True)
    assert len(tokenizer(REXUNINLU_SCHEMA, "a")["input_ids"]) - len(tokenizer("a")["input_ids"]) == 32
    assert manifest_for(KINDS["deberta-v2-tiny"], "token-classification", 0, {}).options == {}


def test_the_folder_loads_offline_with_a_matching_vocabulary(built: Path) -> None:
    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    config = json.loads((built / "config.json").read_text())
    assert config["model_type"] == "deberta-v2" and config["vocab_size"] == WORDPIECE_VOCAB
    assert config["relative_attention"] is True and config["num_hidden_layers"] == 2
    tokenizer = AutoTokenizer.from_pretrained(str(built), local_files_only=True)
    assert len(tokenizer) == WORDPIECE_VOCAB
    model = AutoModelForTokenClassification.from_pretrained(str(built), local_files_only=True).eval()
    enc = tokenizer(["Please help me open my bank account."], return_tensors="pt")
    with torch.inference_mode():
        logits = model(**enc).logits
    assert logits.shape == (1, enc["input_ids"].shape[1], 3) and torch.isfinite(logits).all()


def test_the_seed_decides_the_weights(built: Path, tmp_path: Path) -> None:
    again = synthesize("deberta-v2-tiny", "token-classification", tmp_path / "same" / "1", seed=5)
    other = synthesize("deberta-v2-tiny", "token-classification", tmp_path / "other" / "1", seed=6)
    digest = entry_of(built).manifest.weights.files["model.safetensors"]
    assert again.weights.files["model.safetensors"] == digest
    assert other.weights.files["model.safetensors"] != digest


def test_a_tampered_weight_file_is_refused_naming_it(built: Path, tmp_path: Path) -> None:
    folder = tmp_path / "extract" / "1"
    synthesize("deberta-v2-tiny", "token-classification", folder, seed=5)
    with (folder / "model.safetensors").open("r+b") as f:
        f.seek(-8, 2)
        f.write(b"\x00" * 8)
    with pytest.raises(ConfigError, match=r"extract@1: weight file model.safetensors does not match its sha256"):
        verify_entry(entry_of(folder))


@pytest.mark.parametrize(
    ("kind", "task", "message"),
    [
        ("gpt2", "token-classification", r"unknown kind 'gpt2'; known: deberta-v2-base, deberta-v2-tiny"),
        ("deberta-v2-tiny", "rerank", r"built for token-classification, not 'rerank'"),
    ],
)
def test_unknown_kinds_and_tasks_are_refused(tmp_path: Path, kind: str, task: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        synthesize(kind, task, tmp_path / "m" / "1")
    assert not (tmp_path / "m").exists()


def test_a_version_is_never_overwritten(built: Path) -> None:
    before = (built / MANIFEST_FILE).read_text()
    with pytest.raises(ConfigError, match="versions are immutable"):
        synthesize("deberta-v2-tiny", "token-classification", built, seed=9)
    assert (built / MANIFEST_FILE).read_text() == before


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli_app, ["models", "synth", *args], prog_name="fleet")
    return result.exit_code, result.output


def test_the_command_writes_name_at_version_into_the_repository(tmp_path: Path) -> None:
    code, out = cli("deberta-v2-tiny", "--name", "extract", "--repository", str(tmp_path), "--version", "2")
    assert code == 0, out
    folder = tmp_path / "extract" / "2"
    assert out.strip().splitlines()[-1] == str(folder)
    verify_entry(entry_of(folder))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("deberta-v2-tiny", "--name", "../escape"), "model name '../escape' is not allowed"),
        (("deberta-v2-tiny", "--name", "ok", "--version", "../x"), "--version '../x'"),
        (("deberta-v3-xl", "--name", "ok"), "unknown kind 'deberta-v3-xl'"),
    ],
)
def test_the_command_refuses_bad_arguments_in_one_line(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    code, out = cli(*args, "--repository", str(tmp_path))
    assert code == 2 and message in out and "Traceback" not in out
    assert not any(tmp_path.rglob(MANIFEST_FILE))
