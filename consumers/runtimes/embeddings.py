"""The ``embeddings`` runtime: one vector per text from an encoder model (sentence-transformers style).

Each text is truncated to the model's limit (``options.max_seq_tokens``), run through the encoder (``AutoModel``),
pooled (``mean`` over the real tokens, or the ``cls`` token's state) and, with ``normalize``, L2-normalised; pooling
and normalisation are done in fp32 whatever the model's dtype. ``dimensions`` keeps the first N values of a
Matryoshka model's vector and normalises again; N must be one of the sizes ``options.dimensions`` declares (or the
full size), else that job alone fails naming the allowed sizes.

Outputs hold their vectors as float32 rows of the batch's array (numpy views, not lists): ``output_json`` makes lists
of them, or base64 straight from their bytes, once it knows which the request asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from fleet.consumers.runtimes.base import RuntimeHandler
from fleet.consumers.runtimes.passes import flatten, job_slices, sorted_passes
from fleet.encoding import encode_vector
from fleet.errors import ConfigError, InvalidInput
from fleet.schemas.construct import built
from fleet.schemas.runtimes import EmbeddingsInput, EmbeddingsOutput

if TYPE_CHECKING:
    import torch

_ONE, _MANY = frozenset({"dim", "embedding", "tokens"}), frozenset({"dim", "embeddings", "tokens"})


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str, normalize: bool) -> torch.Tensor:
    """Mean over the real tokens (``mask == 1``) or the first token's state, then (optionally) L2-normalise; in
    fp32."""
    import torch

    if pooling == "cls":
        vectors = hidden[:, 0].to(torch.float32)
    else:
        weights = mask.unsqueeze(-1).to(torch.float32)
        summed = (hidden.to(torch.float32) * weights).sum(dim=1)
        vectors = summed / weights.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(vectors, p=2, dim=1) if normalize else vectors


def mean_pool_normalize(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the real tokens, then L2-normalise (``embed``'s pooling)."""
    return pool(hidden, mask, "mean", True)


def truncate(matrix: np.ndarray, dimensions: int, normalize: bool) -> np.ndarray:
    """The first ``dimensions`` values of each row, normalised again when the runtime normalises."""
    cut = np.ascontiguousarray(matrix[:, :dimensions])
    if normalize and len(cut):
        cut /= np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
    return cut


class EmbeddingsRuntime(RuntimeHandler):
    """Vectors for texts: ``embedding`` for a ``text``, ``embeddings`` for ``texts``."""

    auto_class = "AutoModel"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dim = 0

    def after_load(self) -> None:
        self.dim = int(self.model.config.hidden_size)
        bad = [d for d in self.options.dimensions if d > self.dim]
        if bad:
            raise ConfigError(f"model {self.entry.ref}: options.dimensions {bad} exceed the model's size {self.dim}")

    # -- compute --------------------------------------------------------------------------------------------------
    def embed_with_tokens(self, texts: list[str]) -> tuple[np.ndarray, list[int]]:
        """Embed a flat list of texts, in order: a float32 array ``(len(texts), dim)`` and each text's tokens."""
        import torch

        model, _ = self.loaded()
        ids: list[list[int]] = self.encode(texts)["input_ids"]
        vectors = torch.empty((len(ids), self.dim), dtype=torch.float32)
        budget = self.max_tokens_per_forward or 8192
        with torch.inference_mode():
            for rows in sorted_passes(ids, budget):
                inputs = self.forward_inputs({"input_ids": ids}, rows)
                hidden = model(**inputs).last_hidden_state
                vectors[rows] = pool(
                    hidden, inputs["attention_mask"], self.options.pooling, self.options.normalize
                ).cpu()
        array: np.ndarray = vectors.numpy()
        return array, [len(row) for row in ids]

    def embed_array(self, texts: list[str]) -> np.ndarray:
        """Embed a flat list of texts, in order: a float32 array of shape ``(len(texts), dim)``."""
        return self.embed_with_tokens(texts)[0]

    def embed_texts(self, texts: list[str]) -> list[list[float]]:
        """Embed a flat list of texts, in order, as lists of Python floats (the L3 cache's keys)."""
        result: list[list[float]] = self.embed_array(texts).tolist()  # numpy's tolist is twice as fast as torch's
        return result

    def allowed_dimensions(self) -> list[int]:
        return sorted({*self.options.dimensions, self.dim})

    def predict(self, batch: list[EmbeddingsInput]) -> list[Any]:
        """Built without validation: the values are the floats just computed (validating 384 of them per text cost
        as much as the rest of the output path)."""
        outputs: list[Any] = [None] * len(batch)
        jobs: list[int] = []
        for i, item in enumerate(batch):
            wanted = item.dimensions
            if wanted is not None and self.dim and wanted not in self.allowed_dimensions():
                allowed = ", ".join(map(str, self.allowed_dimensions()))
                outputs[i] = InvalidInput(  # the caller's mistake: a 400 on /v1/embeddings, 422 on /v1/infer
                    f"model {self.name!r} does not take dimensions={wanted}; allowed: {allowed}",
                    [{"loc": ["dimensions"], "msg": f"one of {allowed}", "type": "value_error"}],
                )
            else:
                jobs.append(i)
        texts, counts = flatten([batch[i].items() for i in jobs])
        matrix, tokens = self.embed_with_tokens(texts) if texts else (np.empty((0, self.dim), np.float32), [])
        for i, rows in zip(jobs, job_slices(counts), strict=True):
            outputs[i] = self.job_output(batch[i], matrix[rows], sum(tokens[rows]))
        return outputs

    def job_output(self, item: EmbeddingsInput, matrix: np.ndarray, tokens: int) -> Any:
        dim = matrix.shape[1]
        if item.dimensions is not None and item.dimensions != dim:
            matrix, dim = truncate(matrix, item.dimensions, self.options.normalize), item.dimensions
        cls = self.spec.output_model
        if item.text is not None:
            return built(cls, {"dim": dim, "embedding": matrix[0], "embeddings": None, "tokens": tokens}, set(_ONE))
        return built(cls, {"dim": dim, "embedding": None, "embeddings": matrix, "tokens": tokens}, set(_MANY))

    # -- output ---------------------------------------------------------------------------------------------------
    def output_json(self, output: EmbeddingsOutput, encoding: str = "float") -> Any:
        """The output as a plain dict, without dumping it through pydantic: ``predict`` built it from the floats it
        just computed. Vectors may be float32 arrays (``predict``'s) or lists (a subclass's): ``"float"`` gives
        lists of Python floats, ``"base64"`` base64 of each vector's little-endian float32 bytes (an array's bytes
        are taken as they are: no list in between)."""
        one: Any = output.embedding
        many: Any = output.embeddings
        if encoding == "base64":
            one = None if one is None else encode_vector(one)
            many = None if many is None else [encode_vector(v) for v in many]
        else:
            one = _floats(one)
            if isinstance(many, np.ndarray):
                many = many.tolist()
            elif many is not None:
                many = [_floats(v) for v in many]
        return {"dim": output.dim, "embedding": one, "embeddings": many, "tokens": output.tokens}

    def sample_input(self) -> Any:
        return self.spec.input_model.model_validate({"texts": ["A short warm-up sentence.", "Fleet " * 40, "ok"]})


def _floats(vector: Any) -> Any:
    """A float32 array as a list of Python floats (the float32 values exactly); anything else as it is."""
    return vector.tolist() if isinstance(vector, np.ndarray) else vector
