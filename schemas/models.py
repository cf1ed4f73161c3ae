"""Input and output schemas of the built-in models, and ``ModelSpec``, the declaration every model makes.

A model handler (see ``fleet.consumers.handlers.base``) carries a ``spec``; the gateway validates inputs against
``spec.input_model`` without loading the model itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

from fleet.schemas.runtimes import MAX_CHARS, MAX_TEXTS, EmbeddingsInput, EmbeddingsOutput

EMBED_DIM = 384
EMBED_MAX_TEXTS = MAX_TEXTS
EMBED_MAX_CHARS = MAX_CHARS
SLEEP_MAX_MS = 60_000.0
# embed's cost budget, in estimated tokens: one request of 64 texts at the 256-token cap fits it alone
EMBED_MAX_BATCH_TOKENS = 16_384


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What a model declares: its name, its I/O schemas and its preferred batch limits.

    ``max_batch`` and ``max_wait_ms`` are the batch limits. With ``p99_target_ms`` the worker sizes its batches
    from that target within ``min_batch..max_batch`` and ``0..max_wait_ms`` (``fleet.consumers.batch_control``);
    without it they are used as they are. ``max_batch_cost`` bounds a batch's summed item costs (the handler's
    ``cost``, e.g. tokens) as well as its count.
    """

    name: str
    input_model: type[BaseModel]
    output_model: type[BaseModel]
    max_batch: int = 32
    max_wait_ms: float = 5.0
    description: str = ""
    version: str = "1"
    """Part of every result-cache key: a new version never serves an older version's cached outputs."""
    cache_text: str | None = None
    """The input field whose text the semantic cache (L3) embeds; None: the model has no L3."""
    cache_threshold: float = 0.95
    """The cosine similarity at or above which an earlier request's output answers this one (L3)."""
    cache_embedder: str = "embed"
    """The model whose embedding of ``cache_text`` is the L3 key: a cheaper model than this one (``extract`` keys its
    L3 with ``embed``). The gateway loads each distinct embedder once (``fleet.producers.gateway.cache.embedder``)."""
    p99_target_ms: float | None = None
    min_batch: int = 1
    max_batch_cost: int | None = None
    inline: bool = False
    """The worker runs the handler on its event loop instead of its model thread: only for a handler whose batch
    takes microseconds and never blocks (``echo``), where the thread hop costs more than the work."""
    vector_fields: tuple[str, ...] = ()
    """The output fields that hold vectors (one, or a list of them): what ``encoding_format: base64`` encodes.
    Empty: the model has no vector output and refuses base64."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_batch <= self.max_batch:
            raise ValueError(
                f"model {self.name!r}: need 1 <= min_batch ({self.min_batch}) <= max_batch ({self.max_batch})"
            )
        if self.p99_target_ms is not None and not self.p99_target_ms > 0:
            raise ValueError(f"model {self.name!r}: p99_target_ms must be > 0, got {self.p99_target_ms}")
        if self.max_batch_cost is not None and self.max_batch_cost < 1:
            raise ValueError(f"model {self.name!r}: max_batch_cost must be >= 1, got {self.max_batch_cost}")

    def json_schemas(self) -> dict[str, Any]:
        return {
            "input": self.input_model.model_json_schema(),
            "output": self.output_model.model_json_schema(),
        }


# -- echo -----------------------------------------------------------------------------------------------------
class EchoInput(RootModel[dict[str, Any]]):
    """Any JSON object; echo returns it unchanged."""


class EchoOutput(RootModel[dict[str, Any]]):
    pass


# -- sleep ----------------------------------------------------------------------------------------------------
class SleepInput(BaseModel):
    """A synthetic service time, for scheduling experiments."""

    model_config = ConfigDict(extra="forbid")

    mean_ms: float = Field(10.0, ge=0, le=SLEEP_MAX_MS, description="mean service time in milliseconds")
    distribution: Literal["fixed", "exponential", "lognormal"] = "fixed"
    sigma: float = Field(1.0, gt=0, le=5, description="lognormal shape (std of the underlying normal)")
    seed: int | None = Field(None, description="makes the drawn service time reproducible")


class SleepOutput(BaseModel):
    slept_ms: float
    slowness: float


# -- embed ----------------------------------------------------------------------------------------------------
class EmbedInput(EmbeddingsInput):
    """Either one ``text`` or a list of ``texts`` (at most 64, each at most 20,000 characters): the ``embeddings``
    runtime's input (``dimensions`` takes only 384, the model's one size)."""


class EmbedOutput(EmbeddingsOutput):
    """``embedding`` for a ``text`` input, ``embeddings`` for ``texts``; vectors are L2-normalised."""

    dim: int = EMBED_DIM


ECHO = ModelSpec(
    "echo", EchoInput, EchoOutput, max_batch=64, max_wait_ms=2, description="returns its input", inline=True
)
SLEEP = ModelSpec(
    "sleep", SleepInput, SleepOutput, max_batch=1, max_wait_ms=0, description="waits a synthetic service time"
)
EMBED = ModelSpec(
    "embed",
    EmbedInput,
    EmbedOutput,
    max_batch=64,
    max_wait_ms=5,
    description="all-MiniLM-L6-v2 sentence embeddings, mean-pooled and L2-normalised, 384 floats",
    cache_text="text",
    cache_threshold=0.93,  # benchmarks/bench_cache.py: paraphrases >= 0.94, antonyms <= 0.90 on its labelled pairs
    max_batch_cost=EMBED_MAX_BATCH_TOKENS,
    vector_fields=("embedding", "embeddings"),
)

BUILTIN_SPECS: dict[str, ModelSpec] = {s.name: s for s in (ECHO, SLEEP, EMBED)}
