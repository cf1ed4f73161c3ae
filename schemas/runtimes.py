"""Input and output schemas of the task runtimes that serve a model repository's entries with no code.

Each runtime (``fleet.consumers.runtimes``) takes one of these inputs per job and answers one of these outputs. The
gateway validates a job's input against its runtime's schema without loading weights, and the OpenAI-compatible
and rerank routes (``fleet.producers.gateway.models``) build these inputs from their own request shapes.

Every text input takes either one ``text`` or a list of ``texts``: the output answers in the same shape (one
result, or a list of results in the order of the texts). ``tokens`` in an output is the number of tokens the model
read for the job (after truncation), what the OpenAI routes report as ``usage``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_TEXTS = 64
MAX_CHARS = 20_000
MAX_PASSAGES = 256
MAX_TOP_K = 1_000


class TextsInput(BaseModel):
    """Either one ``text`` or a list of ``texts`` (at most 64, each at most 20,000 characters)."""

    model_config = ConfigDict(extra="forbid")

    text: str | None = Field(None, max_length=MAX_CHARS)
    texts: list[str] | None = Field(None, min_length=1, max_length=MAX_TEXTS)

    @model_validator(mode="after")
    def _exactly_one(self) -> TextsInput:
        if (self.text is None) == (self.texts is None):
            raise ValueError("give exactly one of 'text' (a string) or 'texts' (a list of strings)")
        for i, t in enumerate(self.texts or []):
            if len(t) > MAX_CHARS:
                raise ValueError(f"texts[{i}] has {len(t)} characters, over the limit of {MAX_CHARS}")
        return self

    def items(self) -> list[str]:
        return [self.text] if self.text is not None else list(self.texts or [])


# -- embeddings -----------------------------------------------------------------------------------------------
class EmbeddingsInput(TextsInput):
    """Texts to embed; ``dimensions`` truncates each vector to its first N values and normalises it again
    (Matryoshka models only: N must be one of the sizes the model's ``model.yaml`` declares)."""

    dimensions: int | None = Field(None, ge=1, le=65_536)


class EmbeddingsOutput(BaseModel):
    """``embedding`` for a ``text`` input, ``embeddings`` for ``texts``."""

    dim: int
    embedding: list[float] | str | None = Field(
        None, description="the vector; with encoding_format base64, base64 of its little-endian float32 bytes"
    )
    embeddings: list[list[float]] | list[str] | None = Field(
        None, description="one vector per text; with encoding_format base64, each one a base64 string"
    )
    tokens: int | None = Field(None, description="tokens read for the job, after truncation")


# -- classification -------------------------------------------------------------------------------------------
class ClassificationInput(TextsInput):
    """Texts to classify; ``top_k`` labels per text (default: the model's ``top_k``, else 1; ``0``: every
    label)."""

    top_k: int | None = Field(None, ge=0, le=MAX_TOP_K)


class LabelScore(BaseModel):
    label: str
    score: float


class ClassificationOutput(BaseModel):
    """``labels`` (best first) for a ``text`` input, ``results`` (one list per text) for ``texts``. Scores are
    softmax probabilities, or independent sigmoids for a multi-label model."""

    labels: list[LabelScore] | None = None
    results: list[list[LabelScore]] | None = None
    tokens: int | None = None


# -- token classification -------------------------------------------------------------------------------------
class TokenClassificationInput(TextsInput):
    """Texts to tag; ``aggregation`` groups word pieces into entities (default: the model's, else ``simple``)."""

    aggregation: Literal["none", "simple", "first", "max", "average"] | None = None


class Entity(BaseModel):
    """One entity (or, with ``aggregation: none``, one token): its label, score and character span."""

    label: str
    score: float
    text: str
    start: int = Field(description="character offset of the first character in the input text")
    end: int = Field(description="character offset just past the last character")


class TokenClassificationOutput(BaseModel):
    """``entities`` for a ``text`` input, ``results`` (one list per text) for ``texts``; in text order."""

    entities: list[Entity] | None = None
    results: list[list[Entity]] | None = None
    tokens: int | None = None


# -- rerank ---------------------------------------------------------------------------------------------------
class RerankInput(BaseModel):
    """A ``query`` and the ``texts`` (passages) to score against it, the shape TEI's ``/rerank`` takes."""

    model_config = ConfigDict(extra="forbid")

    query: str = Field(max_length=MAX_CHARS)
    texts: list[str] = Field(min_length=1, max_length=MAX_PASSAGES)
    top_n: int | None = Field(None, ge=1, le=MAX_PASSAGES, description="keep the N best; default: all")
    return_text: bool = False

    @model_validator(mode="after")
    def _bounded(self) -> RerankInput:
        for i, t in enumerate(self.texts):
            if len(t) > MAX_CHARS:
                raise ValueError(f"texts[{i}] has {len(t)} characters, over the limit of {MAX_CHARS}")
        return self


class RerankResult(BaseModel):
    index: int = Field(description="the passage's position in the request's texts")
    score: float = Field(description="relevance: the cross-encoder's logit through a sigmoid, in 0..1")
    text: str | None = None


class RerankOutput(BaseModel):
    """The passages best first (at most ``top_n``)."""

    results: list[RerankResult]
    tokens: int | None = None


# -- the runtimes' options in model.yaml ----------------------------------------------------------------------
MAX_PROMPT_CHARS = 4096


class RuntimeOptions(BaseModel):
    """Options every runtime takes under ``options:`` in ``model.yaml``."""

    model_config = ConfigDict(extra="forbid")

    max_seq_tokens: int | None = Field(
        None, ge=1, le=65_536, description="truncate each text to this many tokens; default: the model's maximum"
    )
    max_tokens_per_forward: int | None = Field(
        None, ge=1, description="padded tokens per forward pass (a batch is cut into passes of this size)"
    )


class EmbeddingsOptions(RuntimeOptions):
    pooling: Literal["mean", "cls"] = "mean"
    normalize: bool = True
    dimensions: list[int] = Field(
        default_factory=list,
        description="Matryoshka sizes the model was trained for (a request's `dimensions` must be one); empty: "
        "only the full size",
    )


class ClassificationOptions(RuntimeOptions):
    top_k: int = Field(1, ge=0, le=MAX_TOP_K, description="labels per text by default (0: every label)")
    multi_label: bool | None = Field(
        None, description="independent sigmoids per label; default: from config.json's problem_type"
    )


class TokenClassificationOptions(RuntimeOptions):
    aggregation: Literal["none", "simple", "first", "max", "average"] = "simple"
    ignore_labels: list[str] = Field(default_factory=lambda: ["O"], description="labels never reported")
    prompt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_PROMPT_CHARS,
        description="text the model reads before each input text, as the first segment of a pair: the schema of a "
        "zero-shot extractor (RexUniNLU, UIE). Its tokens are never tagged; spans stay offsets into the input "
        "text, and only the text is truncated",
    )


class RerankOptions(RuntimeOptions):
    pass


class RuntimeSchema(BaseModel):
    """What the gateway and the repository know of a runtime without loading it: its schemas and options."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    name: str
    task: str  # the Hugging Face task it serves
    input_model: type[BaseModel]
    output_model: type[BaseModel]
    options_model: type[RuntimeOptions]
    vector_fields: tuple[str, ...] = ()
    cache_text: str | None = "text"  # the input field the L3 cache embeds by default


RUNTIME_SCHEMAS: dict[str, RuntimeSchema] = {
    r.name: r
    for r in (
        RuntimeSchema(
            name="embeddings",
            task="feature-extraction",
            input_model=EmbeddingsInput,
            output_model=EmbeddingsOutput,
            options_model=EmbeddingsOptions,
            vector_fields=("embedding", "embeddings"),
        ),
        RuntimeSchema(
            name="classification",
            task="text-classification",
            input_model=ClassificationInput,
            output_model=ClassificationOutput,
            options_model=ClassificationOptions,
        ),
        RuntimeSchema(
            name="token-classification",
            task="token-classification",
            input_model=TokenClassificationInput,
            output_model=TokenClassificationOutput,
            options_model=TokenClassificationOptions,
        ),
        RuntimeSchema(
            name="rerank",
            task="text-ranking",
            input_model=RerankInput,
            output_model=RerankOutput,
            options_model=RerankOptions,
            cache_text=None,  # the same query over other passages is another request
        ),
    )
}
