"""``model.yaml``: what a model repository entry declares (``models/<name>/<version>/model.yaml``).

An entry names the runtime that serves it (``fleet.schemas.runtimes``: ``embeddings``, ``classification``,
``token-classification``, ``rerank``) or a user's handler class, where its weights are with the sha256 of every
file, how it batches and caches, and labels and a description for people. The gateway reads it to validate inputs
(no weights needed); a worker reads it, checks the files' digests and loads the weights.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fleet.schemas.runtimes import RUNTIME_SCHEMAS

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
VERSION_RE = re.compile(r"^[a-z0-9][a-z0-9_]{0,31}$")
MANIFEST_FILE = "model.yaml"
SIGNATURE_FILE = "model.yaml.sig"


class Weights(BaseModel):
    """Where the weights are: ``path`` (a folder, relative to the version folder; default: the version folder
    itself) or ``package`` (an installed Python package whose ``get_model_path()`` or folder holds them), and the
    sha256 of every file that is read, by its path relative to that folder."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = None
    package: str | None = None
    files: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_place(self) -> Weights:
        if self.path is not None and self.package is not None:
            raise ValueError("give at most one of weights.path and weights.package")
        for name, digest in self.files.items():
            if not SHA256_RE.match(digest):
                raise ValueError(f"weights.files[{name!r}]: {digest!r} is not a lower-case hex sha256")
            parts = name.replace("\\", "/").split("/")
            if name.startswith("/") or ".." in parts or not name:
                raise ValueError(f"weights.files: {name!r} must be a relative path inside the weights folder")
        return self


class Batching(BaseModel):
    """The worker's batch limits (``fleet.schemas.models.ModelSpec``)."""

    model_config = ConfigDict(extra="forbid")

    max_batch: int = Field(32, ge=1, le=4096)
    min_batch: int = Field(1, ge=1)
    max_wait_ms: float = Field(5.0, ge=0, le=60_000)
    p99_target_ms: float | None = Field(None, gt=0)
    max_batch_cost: int | None = Field(None, ge=1, description="a batch's summed tokens, at most")


class Cache(BaseModel):
    """The result caches' view of the model: the input field L3 embeds (``null``: no L3), the similarity at which
    an earlier answer is reused, and the repository model whose embeddings are the L3 keys (default ``embed``)."""

    model_config = ConfigDict(extra="forbid")

    text: str | None = None
    threshold: float = Field(0.95, gt=0, le=1)
    embedder: str = "embed"


class ModelManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    runtime: str = Field(description="embeddings, classification, token-classification, rerank or handler")
    handler: str | None = Field(None, description="package.module:Handler, for runtime: handler")
    task: str | None = None
    description: str = ""
    labels: dict[str, str] = Field(default_factory=dict, description="free key/value labels (team, source, ...)")
    weights: Weights = Field(default_factory=Weights)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: str = "auto"
    batching: Batching = Field(default_factory=Batching)
    cache: Cache = Field(default_factory=Cache)
    options: dict[str, Any] = Field(default_factory=dict, description="the runtime's own options")

    @field_validator("runtime")
    @classmethod
    def _known_runtime(cls, value: str) -> str:
        if value != "handler" and value not in RUNTIME_SCHEMAS:
            raise ValueError(f"unknown runtime {value!r}; known: {', '.join([*RUNTIME_SCHEMAS, 'handler'])}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ModelManifest:
        if (self.runtime == "handler") != (self.handler is not None):
            raise ValueError("runtime: handler needs handler: package.module:Class, and only it takes one")
        if self.runtime in RUNTIME_SCHEMAS:
            try:
                RUNTIME_SCHEMAS[self.runtime].options_model.model_validate(self.options)
            except ValidationError as exc:  # named from the top of model.yaml: options.prompt, not prompt
                first = exc.errors(include_url=False)[0]
                where = ".".join(str(part) for part in ("options", *first["loc"]))
                message = "not an option of this runtime" if first["type"] == "extra_forbidden" else first["msg"]
                raise ValueError(f"{where}: {message}") from None
        if self.batching.min_batch > self.batching.max_batch:
            raise ValueError("batching.min_batch is over batching.max_batch")
        return self
