"""Check a repository entry's files against the sha256 digests its ``model.yaml`` lists, before any is loaded.

A worker calls ``verify_entry`` in its handler's ``load``: a file whose digest differs, or that is missing, stops the
load with one line naming the file. An entry a runtime serves must hold safetensors weights: one whose weights are
only pickles (``pytorch_model.bin``; unpickling runs code) is refused here too, before anything is read. Files in
the weights folder that ``model.yaml`` does not list are never read by this check (the runtimes refuse to load a
folder holding an unlisted loadable file, ``fleet.consumers.runtimes.base.check_loadable``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from fleet.errors import ConfigError
from fleet.repository.entry import RepositoryEntry

CHUNK_BYTES = 1 << 20
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def pickled_only(names: Iterable[str]) -> list[str]:
    """The pickled weight files among ``names`` when there is no ``.safetensors`` file beside them, else []."""
    names = list(names)
    if any(name.endswith(".safetensors") for name in names):
        return []
    return sorted(name for name in names if name.endswith(PICKLED_SUFFIXES))


def pickle_refusal(where: str, pickled: list[str]) -> str:
    return (
        f"{where} holds only pickled weights ({', '.join(pickled)}), which Fleet never loads (unpickling runs "
        "code): convert them to safetensors (model.save_pretrained(folder, safe_serialization=True))"
    )


def verify_entry(entry: RepositoryEntry) -> None:
    """Raise ``ConfigError`` naming the first listed file that is missing or whose sha256 differs, or saying that a
    runtime's weights are only pickles.

    Raises:
        ConfigError: a file is missing or tampered with; pickled weights only.
    """
    files = entry.manifest.weights.files
    if entry.manifest.runtime != "handler":
        pickled = pickled_only(files)
        if pickled:
            raise ConfigError(pickle_refusal(f"model {entry.ref}", pickled))
    for name, expected in sorted(files.items()):
        path = entry.weights_dir / name
        if not path.is_file():
            raise ConfigError(f"model {entry.ref}: weight file {name} is missing from {entry.weights_dir}")
        if sha256_of(path) != expected:
            raise ConfigError(f"model {entry.ref}: weight file {name} does not match its sha256 in model.yaml")
