"""Check a repository entry's files against the sha256 digests its ``model.yaml`` lists, before any is loaded.

A worker calls ``verify_entry`` in its handler's ``load``: a file whose digest differs, or that is missing, stops the
load with one line naming the file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from fleet.errors import ConfigError
from fleet.repository.entry import RepositoryEntry

CHUNK_BYTES = 1 << 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def verify_entry(entry: RepositoryEntry) -> None:
    """Raise ``ConfigError`` naming the first listed file that is missing or whose sha256 differs.

    Raises:
        ConfigError: a file is missing or tampered with.
    """
    for name, expected in sorted(entry.manifest.weights.files.items()):
        path = entry.weights_dir / name
        if not path.is_file():
            raise ConfigError(f"model {entry.ref}: weight file {name} is missing from {entry.weights_dir}")
        if sha256_of(path) != expected:
            raise ConfigError(f"model {entry.ref}: weight file {name} does not match its sha256 in model.yaml")
