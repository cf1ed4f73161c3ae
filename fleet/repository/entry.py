"""One version of one model in the repository, and the ``ModelSpec`` it is served with.

Reading an entry never loads weights, so the gateway can validate inputs of models whose weights it does not hold.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fleet.schemas.manifest import ModelManifest
from fleet.schemas.models import ModelSpec
from fleet.schemas.runtimes import RUNTIME_SCHEMAS

# a batch's summed estimated tokens when model.yaml sets no batching.max_batch_cost (every runtime reads text)
DEFAULT_MAX_BATCH_TOKENS = 16_384


@dataclasses.dataclass(frozen=True, slots=True)
class RepositoryEntry:
    """``name`` at ``version``: its version folder, the folder its weights are read from, and its manifest."""

    name: str
    version: str
    folder: Path
    weights_dir: Path
    manifest: ModelManifest

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


def spec_for(entry: RepositoryEntry) -> ModelSpec:
    """The spec a runtime entry is served with: the runtime's schemas, the manifest's batching and cache.

    Raises:
        ValueError: the entry is served by a handler class (its spec is the class's own).
    """
    manifest = entry.manifest
    runtime = RUNTIME_SCHEMAS.get(manifest.runtime)
    if runtime is None:
        raise ValueError(f"{entry.ref} is served by its handler class {manifest.handler}, not by a runtime")
    batching = manifest.batching
    return ModelSpec(
        entry.name,
        runtime.input_model,
        runtime.output_model,
        max_batch=batching.max_batch,
        min_batch=batching.min_batch,
        max_wait_ms=batching.max_wait_ms,
        p99_target_ms=batching.p99_target_ms,
        max_batch_cost=batching.max_batch_cost or DEFAULT_MAX_BATCH_TOKENS,
        description=manifest.description,
        version=entry.version,
        cache_text=manifest.cache.text,
        cache_threshold=manifest.cache.threshold,
        cache_embedder=manifest.cache.embedder,
        vector_fields=runtime.vector_fields,
    )
