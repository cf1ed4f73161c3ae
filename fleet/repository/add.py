"""Adding a folder of weights to the repository as a new version (``fleet models add``, and ``fleet models pull``
after its download): the sha256 of every file into a new ``model.yaml``.

1. The source's files are listed (hidden ones, ``model.yaml`` and its signature left out; symbolic links to
   folders not followed). A folder with only pickled weights is refused; pickles beside safetensors are left out
   (not listed, not copied, so never read).
2. The runtime is the one given, else read from ``config.json``'s ``architectures``: ``*ForSequenceClassification``
   is ``classification`` (``rerank`` when it has a single label: a cross-encoder's score),
   ``*ForTokenClassification`` ``token-classification``, a bare encoder (``BertModel``, ...) or a
   sentence-transformers folder ``embeddings``; anything else asks for ``--runtime``.
3. The version folder is written under a hidden temporary name and renamed into place when complete, so no reader
   ever sees half a version, and an existing version is never written over (versions are immutable).

``copy`` copies the files into the version folder; ``link`` leaves them where they are (``weights.path`` names the
source folder, absolute); ``move`` moves them (pull's download, already inside the repository's filesystem).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from fleet.errors import ConfigError
from fleet.repository.entry import RepositoryEntry
from fleet.repository.layout import Repository, check_model_name, check_version, manifest_problem
from fleet.repository.verify import PICKLED_SUFFIXES, pickle_refusal, pickled_only, sha256_of
from fleet.schemas.manifest import MANIFEST_FILE, SIGNATURE_FILE, ModelManifest
from fleet.schemas.runtimes import RUNTIME_SCHEMAS

MAX_FILES = 10_000
Mode = Literal["copy", "link", "move"]


@dataclasses.dataclass(slots=True)
class Added:
    """What ``add_folder`` wrote, and what it has to say about it (a runtime it chose, files it left out)."""

    entry: RepositoryEntry
    notes: list[str]


def source_files(source: Path) -> list[str]:
    """Relative paths (with ``/``) of the files under ``source`` that an entry lists, sorted."""
    if not source.is_dir():
        raise ConfigError(f"{source}: no such folder")
    found: list[str] = []
    for top, dirs, files in os.walk(source, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for file in files:
            if file.startswith(".") or (top == str(source) and file in (MANIFEST_FILE, SIGNATURE_FILE)):
                continue
            path = Path(top, file)
            if path.is_file():
                found.append(path.relative_to(source).as_posix())
            if len(found) > MAX_FILES:
                raise ConfigError(f"{source}: over {MAX_FILES:,} files; a model folder holds far fewer")
    if not found:
        raise ConfigError(f"{source}: no files to add")
    return sorted(found)


def weight_files(source: Path, names: list[str], notes: list[str]) -> list[str]:
    """``names`` without pickled weights, which are refused when they are all the weights there are."""
    pickled = pickled_only(names)
    if pickled:
        raise ConfigError(pickle_refusal(str(source), pickled))
    left_out = [n for n in names if n.endswith(PICKLED_SUFFIXES)]
    if left_out:
        notes.append(f"left out {', '.join(left_out)} (pickled weights; the safetensors beside them are served)")
    return [n for n in names if n not in left_out]


def infer_runtime(source: Path, notes: list[str]) -> str:
    """The runtime ``config.json`` implies (see the module's docstring), or ``ConfigError`` asking for one."""
    ask = "pass --runtime " + "|".join(RUNTIME_SCHEMAS)
    config = _read_config(source)
    if config is None:
        if (source / "modules.json").is_file():
            return "embeddings"
        raise ConfigError(f"{source}: no config.json to tell the runtime from; {ask}")
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ConfigError(f"{source}/config.json: architectures is not a list of names; {ask}")
    for arch in architectures:
        if arch.endswith("ForSequenceClassification"):
            if _num_labels(config) == 1:
                notes.append(
                    f"{arch} with a single label: served as rerank (a cross-encoder's relevance score); "
                    "pass --runtime classification for a one-label classifier"
                )
                return "rerank"
            return "classification"
        if arch.endswith("ForTokenClassification"):
            return "token-classification"
        if arch.endswith("Model") and not any(part in arch for part in ("For", "Head", "LM")):
            return "embeddings"
    if not architectures and (source / "modules.json").is_file():
        return "embeddings"
    named = ", ".join(architectures) or "none"
    raise ConfigError(f"{source}/config.json: cannot tell the runtime from architectures ({named}); {ask}")


def _read_config(source: Path) -> dict[str, Any] | None:
    path = source / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return config


def _num_labels(config: dict[str, Any]) -> int:
    id2label = config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        return len(id2label)
    num = config.get("num_labels")
    return num if isinstance(num, int) else 2


def next_version(repo: Repository, name: str) -> str:
    numbers = [int(v) for v in repo.versions(name) if v.isdigit()]
    return str(max(numbers, default=0) + 1)


def manifest_text(manifest: ModelManifest, header: str) -> str:
    """The manifest as YAML: ``runtime`` first, then what differs from the defaults."""
    data = manifest.model_dump(mode="json", exclude_defaults=True)
    ordered = {"runtime": manifest.runtime, **{k: v for k, v in data.items() if k != "runtime"}}
    return f"# {header}\n" + yaml.safe_dump(ordered, sort_keys=False, allow_unicode=True, width=120)


def add_folder(
    repo: Repository,
    source: Path,
    name: str,
    *,
    version: str | None = None,
    runtime: str | None = None,
    task: str | None = None,
    description: str = "",
    labels: dict[str, str] | None = None,
    mode: Mode = "copy",
) -> Added:
    """Write ``source`` into ``repo`` as ``name`` at ``version`` (default: one past its highest number).

    Raises:
        ConfigError: a bad name or version, a version that exists, a folder of pickles, a runtime that cannot be
            told, or a file that cannot be read or written.
    """
    check_model_name(name)
    version = check_version(version) if version is not None else next_version(repo, name)
    if version in repo.versions(name):
        raise ConfigError(f"model {name}@{version} exists already in {repo.root}; versions are never rewritten")
    source = source.resolve()
    notes: list[str] = []
    names = weight_files(source, source_files(source), notes)
    if runtime is None:
        runtime = infer_runtime(source, notes)
        notes.append(f"runtime {runtime} (from config.json); --runtime chooses another")
    parent = repo.root / name
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{version}.", dir=parent))
    except OSError as exc:
        raise ConfigError(f"cannot write {parent}: {exc.strerror or exc}") from None
    try:
        read_from = source if mode == "link" else _stage(source, names, staging, mode)
        weights: dict[str, Any] = {"files": {n: sha256_of(read_from / n) for n in names}}  # of what is served
        if mode == "link":
            weights["path"] = str(source)
        manifest = _manifest(name, version, runtime, task, description, labels or {}, weights)
        header = f"{name}@{version}, written by fleet models: the sha256 of every file that is read"
        (staging / MANIFEST_FILE).write_text(manifest_text(manifest, header))
        staging.chmod(0o755)
        os.rename(staging, parent / version)  # fails when the version appeared meanwhile: never written over
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise ConfigError(f"cannot write {parent / version}: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Added(repo.get(name, version), notes)


def _stage(source: Path, names: list[str], staging: Path, mode: Mode) -> Path:
    for rel in names:
        target = staging / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if mode == "move":
            shutil.move(source / rel, target)
        else:
            shutil.copyfile(source / rel, target)
    return staging


def _manifest(
    name: str,
    version: str,
    runtime: str,
    task: str | None,
    description: str,
    labels: dict[str, str],
    weights: dict[str, Any],
) -> ModelManifest:
    data = {"runtime": runtime, "task": task, "description": description, "labels": labels, "weights": weights}
    try:
        return ModelManifest.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"model {name}@{version}: {manifest_problem(exc)}") from None
