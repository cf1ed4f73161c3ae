"""Small models for the OpenAI-compatible and rerank routes' tests, served by path (``tests.openai_handlers:Overlap``).

``ToyEmbed`` is an embeddings model of the runtimes' schemas (``EmbeddingsInput`` / ``EmbeddingsOutput``) with
Matryoshka sizes: each text's vector is drawn from its sha256 (so equal texts get equal vectors and a test can
compute the expected one), ``dimensions`` keeps the first 4 or 8 values, normalised again, and ``tokens`` counts
words. It takes at most ``TOY_MAX_TEXTS`` texts a job, so a request of more runs several jobs. ``Overlap`` is a
rerank model of ``RerankInput`` / ``RerankOutput`` that scores a passage by the share of the query's words it
holds.
"""

from __future__ import annotations

import hashlib
import math
import struct

from pydantic import Field

from fleet.consumers.handlers.base import ModelHandler
from fleet.errors import InvalidInput
from fleet.schemas.models import ModelSpec
from fleet.schemas.runtimes import EmbeddingsInput, EmbeddingsOutput, RerankInput, RerankOutput, RerankResult

TOY_DIM = 16
TOY_SIZES = (4, 8)
TOY_MAX_TEXTS = 8


def toy_vector(text: str, dimensions: int | None = None) -> list[float]:
    """``ToyEmbed``'s vector of ``text`` (float32 values), first ``dimensions`` of them, L2-normalised."""
    raw = hashlib.sha256(text.encode()).digest() + hashlib.sha256(b"more" + text.encode()).digest()
    values = [b / 255 - 0.5 for b in raw[:TOY_DIM]][: dimensions or TOY_DIM]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [struct.unpack("<f", struct.pack("<f", v / norm))[0] for v in values]


class ToyEmbedInput(EmbeddingsInput):
    texts: list[str] | None = Field(None, min_length=1, max_length=TOY_MAX_TEXTS)


class ToyEmbed(ModelHandler[ToyEmbedInput, EmbeddingsOutput]):
    spec = ModelSpec(
        "toy-embed",
        ToyEmbedInput,
        EmbeddingsOutput,
        max_batch=16,
        max_wait_ms=2,
        description="hash vectors with Matryoshka sizes 4 and 8 (a test model)",
        vector_fields=("embedding", "embeddings"),
    )

    def predict(self, batch: list[ToyEmbedInput]) -> list[EmbeddingsOutput | Exception]:
        return [self._one(item) for item in batch]

    @staticmethod
    def _one(item: ToyEmbedInput) -> EmbeddingsOutput | Exception:
        if item.dimensions is not None and item.dimensions not in TOY_SIZES:
            return InvalidInput(f"dimensions {item.dimensions} is not one of this model's sizes {list(TOY_SIZES)}")
        texts = item.items()
        vectors = [toy_vector(t, item.dimensions) for t in texts]
        tokens = sum(len(t.split()) for t in texts)
        dim = len(vectors[0])
        if item.text is not None:
            return EmbeddingsOutput(dim=dim, embedding=vectors[0], tokens=tokens)
        return EmbeddingsOutput(dim=dim, embeddings=vectors, tokens=tokens)


def overlap(query: str, passage: str) -> float:
    """The share of the query's (lower-cased) words that ``passage`` holds."""
    words = set(query.lower().split())
    return len(words & set(passage.lower().split())) / (len(words) or 1)


class Overlap(ModelHandler[RerankInput, RerankOutput]):
    spec = ModelSpec(
        "overlap", RerankInput, RerankOutput, max_batch=8, max_wait_ms=2, description="word-overlap rerank (test)"
    )

    def predict(self, batch: list[RerankInput]) -> list[RerankOutput | Exception]:
        return [self._one(item) for item in batch]

    @staticmethod
    def _one(item: RerankInput) -> RerankOutput:
        scored = [
            RerankResult(index=i, score=overlap(item.query, t), text=t if item.return_text else None)
            for i, t in enumerate(item.texts)
        ]
        scored.sort(key=lambda r: (-r.score, r.index))
        tokens = len(item.query.split()) * len(item.texts) + sum(len(t.split()) for t in item.texts)
        return RerankOutput(results=scored[: item.top_n], tokens=tokens)
