"""``RuntimeHandler``: the ``ModelHandler`` every task runtime builds on, bound to one repository entry.

The class is cheap to make and to construct (no torch import); ``load`` is where the work is, in this order:

1. ``verify_entry``: every file ``model.yaml`` lists must match its sha256, or the load stops with one line naming
   the file; a loadable file (config, tokenizer, weights) that ``model.yaml`` does not list is refused the same way,
   so nothing unverified is read.
2. The weights must be safetensors: a folder holding only pickled weights (``.bin``, ``.pt``) is refused, since
   unpickling runs code. transformers reads them with ``use_safetensors=True`` and ``local_files_only=True``.
3. Config, tokenizer and model are read with transformers' Auto classes; the model goes to the device (the
   manifest's ``device``, else the worker's) in the manifest's ``dtype`` (``auto``: fp16 on CUDA, fp32 on CPU).

A runtime subclass names its Auto class and implements ``predict`` with the passes of
``fleet.consumers.runtimes.passes``; ``cost`` estimates tokens without a tokenizer so the worker bounds a batch by
``spec.max_batch_cost``.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import ValidationError

from fleet.consumers.device import is_cuda, resolve_device, torch_dtype_for
from fleet.consumers.handlers.base import ModelHandler
from fleet.consumers.replicas import in_replica
from fleet.consumers.runtimes.passes import default_tokens_per_forward, estimate_tokens
from fleet.errors import ConfigError
from fleet.repository.entry import RepositoryEntry
from fleet.repository.verify import verify_entry
from fleet.schemas.manifest import MANIFEST_FILE, SIGNATURE_FILE
from fleet.schemas.runtimes import RUNTIME_SCHEMAS
from fleet.torch_threads import set_for_this_thread

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# files transformers may read from a model folder: each must be listed (and so verified) in model.yaml
LOADABLE_SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".tiktoken")
DEFAULT_MAX_SEQ_TOKENS = 512
_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def check_loadable(entry: RepositoryEntry) -> None:
    """Refuse a folder whose weights are not safetensors, or that holds a loadable file ``model.yaml`` does not list.

    Raises:
        ConfigError: one line naming the folder or the file.
    """
    folder = entry.weights_dir
    if not folder.is_dir():
        raise ConfigError(f"model {entry.ref}: weights folder {folder} does not exist")
    files = sorted(p for p in folder.iterdir() if p.is_file())
    if not any(p.suffix == ".safetensors" for p in files):
        pickled = [p.name for p in files if p.suffix in PICKLED_SUFFIXES]
        if pickled:
            raise ConfigError(
                f"model {entry.ref}: {folder} holds only pickled weights ({', '.join(pickled)}), which Fleet never "
                "loads (unpickling runs code); convert them to safetensors (model.save_pretrained(dir, "
                "safe_serialization=True))"
            )
        raise ConfigError(f"model {entry.ref}: no *.safetensors weights in {folder}")
    listed = set(entry.manifest.weights.files)
    for path in files:
        if path.name in (MANIFEST_FILE, SIGNATURE_FILE) or path.suffix not in LOADABLE_SUFFIXES:
            continue
        if path.name not in listed:
            raise ConfigError(
                f"model {entry.ref}: {path.name} in {folder} is not listed with its sha256 in model.yaml; "
                "write the manifest again (fleet models add) or remove the file"
            )


def torch_dtype(name: str, device: str) -> torch.dtype:
    """The manifest's ``dtype`` as a torch dtype; ``auto`` is fp16 on CUDA, fp32 on CPU."""
    import torch

    if name == "auto":
        return torch_dtype_for(device)
    dtype: torch.dtype = getattr(torch, _DTYPES[name])
    return dtype


class RuntimeHandler(ModelHandler[Any, Any]):
    """A task runtime serving ``entry``; ``fleet.consumers.runtimes.runtime_handler`` makes one class per entry."""

    entry: ClassVar[RepositoryEntry]
    auto_class: ClassVar[str] = "AutoModel"
    replica_safe = True  # torch modules in inference mode are; the tokenizer is copied per replica thread

    def __init__(
        self, *, device: str = "cpu", slowness: float = 1.0, max_tokens_per_forward: int | None = None
    ) -> None:
        """Args:
        max_tokens_per_forward: padded tokens per forward pass; default: the manifest's option, else 8192 on
            CPU and 65536 on CUDA.
        """
        super().__init__(device=device, slowness=slowness)
        self.options = self.parse_options(self.entry)
        self.max_tokens_per_forward = max_tokens_per_forward or self.options.max_tokens_per_forward
        self.max_seq_tokens = self.options.max_seq_tokens or DEFAULT_MAX_SEQ_TOKENS
        self.model: Any = None
        self.tokenizer: Any = None
        self.pad_id = 0
        self.type_ids = False  # the model takes token_type_ids (BERT-like), so pairs mark their second segment
        self.prompt_tokens = 0  # tokens the runtime reads with every text besides its own (a prompt), for ``cost``
        self._replica = threading.local()  # a replica thread's own tokenizer (start_replica)

    @staticmethod
    def parse_options(entry: RepositoryEntry) -> Any:
        schema = RUNTIME_SCHEMAS[entry.manifest.runtime]
        try:
            return schema.options_model.model_validate(entry.manifest.options)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ConfigError(f"model {entry.ref}: model.yaml options.{where}: {first['msg']}") from None

    # -- loading ------------------------------------------------------------------------------------------------
    def load(self) -> None:
        """Verify the files, then read tokenizer and safetensors weights offline onto the device.

        Raises:
            ConfigError: a file is missing, tampered with or unlisted; the weights are not safetensors; the
                folder does not hold a model transformers can read.
        """
        started = time.perf_counter()
        entry = self.entry
        wanted = entry.manifest.device if entry.manifest.device != "auto" else self.device
        self.device = resolve_device(wanted)
        verify_entry(entry)
        check_loadable(entry)
        dtype = torch_dtype(entry.manifest.dtype, self.device)
        self.tokenizer = self.read_tokenizer(entry.weights_dir)
        self.model = self.read_model(entry.weights_dir, dtype).to(self.device).eval()
        self.pad_id = int(self.tokenizer.pad_token_id or 0)
        self.type_ids = "token_type_ids" in getattr(self.tokenizer, "model_input_names", ())
        self.max_seq_tokens = self.options.max_seq_tokens or self.model_max_tokens()
        if self.max_tokens_per_forward is None:
            self.max_tokens_per_forward = default_tokens_per_forward(is_cuda(self.device))
        self.after_load()
        log.info(
            "model %s (%s runtime) loaded from %s on %s (%s) in %.2fs",
            entry.ref,
            entry.manifest.runtime,
            entry.weights_dir,
            self.device,
            dtype,
            time.perf_counter() - started,
        )

    def read_tokenizer(self, folder: Path) -> Any:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model {self.entry.ref}: no tokenizer transformers can read in {folder}: {exc}") from exc

    def read_model(self, folder: Path, dtype: torch.dtype) -> Any:
        import transformers

        auto = getattr(transformers, self.auto_class)
        try:
            return auto.from_pretrained(str(folder), local_files_only=True, use_safetensors=True, dtype=dtype)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model {self.entry.ref}: cannot read the model in {folder}: {exc}") from exc

    def model_max_tokens(self) -> int:
        """The longest input the model takes: the tokenizer's and the config's limits, the smaller."""
        limits = [int(self.tokenizer.model_max_length)] if self.tokenizer.model_max_length < 1_000_000 else []
        positions = getattr(self.model.config, "max_position_embeddings", None)
        if positions:
            limits.append(int(positions))
        return min(limits) if limits else DEFAULT_MAX_SEQ_TOKENS

    def after_load(self) -> None:
        """Read what the runtime needs from the loaded model (labels, sizes); the default reads nothing."""

    def loaded(self) -> tuple[Any, Any]:
        """The model and this thread's tokenizer."""
        if self.model is None or self.tokenizer is None:
            raise RuntimeError(f"{type(self).__name__}.load() must be called before predict")
        return self.model, self.thread_tokenizer()

    # -- replicas -----------------------------------------------------------------------------------------------
    def start_replica(self, threads: int) -> None:
        """A replica thread: its own intra-op thread count, its own CUDA stream (kernels of replicas overlap on
        the device), and its own tokenizer copy. The weights stay one copy, shared.

        A Hugging Face fast tokenizer keeps its truncation and padding settings in the instance and changes them
        during a call; two threads calling one instance can collide (tokenizers raises "Already borrowed"), and
        their settings could differ. A copy is small next to the weights (the vocabulary, ~1 MB for BERT's)."""
        import torch

        set_for_this_thread(max(1, threads))  # this thread's OpenMP team; threads started later keep the process's
        if is_cuda(self.device):
            torch.cuda.set_stream(torch.cuda.Stream(device=self.device))  # the current stream is per thread
        self.thread_tokenizer()

    def thread_tokenizer(self) -> Any:
        """The tokenizer this thread uses: in a replica thread (``fleet.consumers.replicas.in_replica``) its own
        copy, made on first use and again if the handler was loaded again since; elsewhere the loaded one."""
        local = self._replica
        if getattr(local, "source", None) is self.tokenizer:
            return local.tokenizer
        if not in_replica() or self.tokenizer is None:
            return self.tokenizer
        local.source, local.tokenizer = self.tokenizer, copy.deepcopy(self.tokenizer)
        return local.tokenizer

    # -- tokens -------------------------------------------------------------------------------------------------
    def encode(
        self, texts: list[str], pairs: list[str] | None = None, *, offsets: bool = False, truncation: bool | str = True
    ) -> dict[str, Any]:
        """Token ids of each text (or (text, pair) pair), special tokens included, truncated (``truncation``: as
        the tokenizer takes it, e.g. ``only_second``), unpadded. With ``offsets``: the character offsets and special
        tokens too, and for pairs ``sequence_ids`` (each token's segment, 0 or 1; None for a special token)."""
        _, tokenizer = self.loaded()
        enc = tokenizer(
            texts,
            pairs,
            truncation=truncation,
            max_length=self.max_seq_tokens,
            return_attention_mask=False,
            return_token_type_ids=self.type_ids and pairs is not None,
            return_offsets_mapping=offsets,
            return_special_tokens_mask=offsets,
        )
        out: dict[str, Any] = dict(enc)
        if offsets and pairs is not None:
            out["sequence_ids"] = [enc.sequence_ids(i) for i in range(len(texts))]
        return out

    def forward_inputs(self, enc: dict[str, Any], rows: list[int]) -> dict[str, Any]:
        """The model's keyword arguments for one forward pass over ``rows`` of ``enc``."""
        from fleet.consumers.runtimes.passes import pad_batch, pad_rows

        input_ids, mask = pad_batch([enc["input_ids"][i] for i in rows], self.pad_id, self.device)
        inputs = {"input_ids": input_ids, "attention_mask": mask}
        if "token_type_ids" in enc:
            inputs["token_type_ids"] = pad_rows([enc["token_type_ids"][i] for i in rows], 0, self.device)
        return inputs

    def cost(self, item: Any) -> int:
        """Estimated tokens of the item's texts, each with ``prompt_tokens``, without running the tokenizer."""
        cap, prompt = self.max_seq_tokens, self.prompt_tokens
        texts: list[str] = item.items()
        return sum(min(cap, prompt + estimate_tokens(len(text), cap)) for text in texts)

    def close(self) -> None:
        """Drop the weights and return cached device memory."""
        self.model = None
        self.tokenizer = None
        if is_cuda(self.device):
            import torch

            torch.cuda.empty_cache()
