"""TEMPORARY, for ``bench_cache`` until the token-classification runtime is merged: ``extract`` served by a
minimal handler of its own. At the merge, ``bench_cache --model extract`` serves it from the repository through
``fleet.consumers.runtimes`` instead, and this module goes.

``TempExtractHandler`` loads the synthesised ``extract`` folder (``fleet models synth deberta-v2-base --task
token-classification --name extract``; the version folder from ``FLEET_BENCH_EXTRACT_DIR``), checks its files
against ``model.yaml``, and tags each text with AutoModelForTokenClassification. A batch is tokenized once, sorted
by length and cut into forward passes of at most 8,192 padded tokens, as ``embed`` does (self-contained here, so
that nothing else depends on this module);
consecutive tokens tagged other than ``O`` make one entity with character offsets. The spec is what the
repository entry's would be: the token-classification schemas, L3 keyed by ``embed``'s vectors of ``text``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from fleet.consumers.device import resolve_device, torch_dtype_for
from fleet.consumers.handlers.base import ModelHandler
from fleet.errors import ConfigError
from fleet.repository.entry import RepositoryEntry
from fleet.repository.verify import verify_entry
from fleet.schemas.manifest import MANIFEST_FILE, ModelManifest
from fleet.schemas.models import EMBED, ModelSpec
from fleet.schemas.runtimes import Entity, TokenClassificationInput, TokenClassificationOutput

EXTRACT_DIR_ENV = "FLEET_BENCH_EXTRACT_DIR"
MAX_SEQ_TOKENS = 512
TOKENS_PER_FORWARD = 8192  # padded tokens a forward pass, as embed's on a CPU

SPEC = ModelSpec(
    "extract",
    TokenClassificationInput,
    TokenClassificationOutput,
    max_batch=16,
    max_wait_ms=5,
    description="TEMPORARY benchmark handler of the extract cost stand-in (outputs meaningless)",
    cache_text="text",
    cache_threshold=EMBED.cache_threshold,
    cache_embedder="embed",
)


def read_entry(folder: Path) -> RepositoryEntry:
    """The repository entry of a version folder (``models/extract/1``)."""
    manifest = ModelManifest.model_validate(yaml.safe_load((folder / MANIFEST_FILE).read_text()))
    return RepositoryEntry(folder.parent.name, folder.name, folder, folder, manifest)


def passes(lengths: list[int], order: list[int]) -> list[list[int]]:
    """``order`` (rows sorted longest first, ``lengths`` theirs) cut into passes of at most TOKENS_PER_FORWARD."""
    out, start = [], 0
    while start < len(order):
        rows = max(1, TOKENS_PER_FORWARD // max(lengths[start], 1))
        out.append(order[start : start + rows])
        start += rows
    return out


def pad(ids: list[list[int]], pad_id: int, device: str) -> tuple[Any, Any]:
    """Right-pad token ids to the longest row: ``(input_ids, attention_mask)``."""
    import torch

    longest = max(len(row) for row in ids)
    input_ids = torch.tensor([row + [pad_id] * (longest - len(row)) for row in ids], dtype=torch.long)
    mask = torch.tensor([[1] * len(row) + [0] * (longest - len(row)) for row in ids], dtype=torch.long)
    return input_ids.to(device), mask.to(device)


class TempExtractHandler(ModelHandler[TokenClassificationInput, TokenClassificationOutput]):
    spec = SPEC

    def __init__(self, *, device: str = "cpu", slowness: float = 1.0, model_path: str | None = None) -> None:
        super().__init__(device=device, slowness=slowness)
        self.model_path = model_path
        self._model: Any = None
        self._tokenizer: Any = None
        self._labels: dict[int, str] = {}

    def load(self) -> None:
        from transformers import AutoModelForTokenClassification, AutoTokenizer

        where = self.model_path or os.environ.get(EXTRACT_DIR_ENV)
        if not where:
            raise ConfigError(f"TempExtractHandler: set {EXTRACT_DIR_ENV} to the extract version folder")
        folder = Path(where)
        verify_entry(read_entry(folder))
        self.device = resolve_device(self.device)
        self._tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        model = AutoModelForTokenClassification.from_pretrained(str(folder), local_files_only=True)
        self._model = model.to(device=self.device, dtype=torch_dtype_for(self.device)).eval()
        self._labels = {int(k): v for k, v in model.config.id2label.items()}

    def sample_input(self) -> TokenClassificationInput:
        return TokenClassificationInput(texts=["A short warm-up sentence.", "Fleet " * 40])

    def predict(self, batch: list[TokenClassificationInput]) -> list[TokenClassificationOutput | Exception]:
        texts = [item.items() for item in batch]
        flat = [t for job in texts for t in job]
        tagged = self.tag(flat)
        outputs: list[TokenClassificationOutput | Exception] = []
        start = 0
        for item, job in zip(batch, texts, strict=True):
            rows, start = tagged[start : start + len(job)], start + len(job)
            tokens = sum(n for _, n in rows)
            if item.text is not None:
                outputs.append(TokenClassificationOutput(entities=rows[0][0], tokens=tokens))
            else:
                outputs.append(TokenClassificationOutput(results=[r for r, _ in rows], tokens=tokens))
        return outputs

    def tag(self, texts: list[str]) -> list[tuple[list[Entity], int]]:
        """Each text's entities and token count."""
        import torch

        enc = self._tokenizer(texts, truncation=True, max_length=MAX_SEQ_TOKENS, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]), reverse=True)
        out: list[tuple[list[Entity], int]] = [([], 0)] * len(ids)
        with torch.inference_mode():
            for rows in passes([len(ids[i]) for i in order], order):
                input_ids, mask = pad([ids[i] for i in rows], self._tokenizer.pad_token_id or 0, self.device)
                probs = self._model(input_ids=input_ids, attention_mask=mask).logits.float().softmax(-1).cpu()
                scores, labels = probs.max(-1)
                for row, i in enumerate(rows):
                    n = len(ids[i])
                    spans = self._spans(texts[i], offsets[i], labels[row, :n].tolist(), scores[row, :n].tolist())
                    out[i] = (spans, n)
        return out

    def _spans(self, text: str, offsets: list[tuple[int, int]], labels: list[int], scores: list[float]) -> list[Entity]:
        """Consecutive tokens tagged other than ``O`` (special tokens, with an empty offset, break a span)."""
        spans: list[Entity] = []
        current: list[tuple[int, int, float]] = []
        for (begin, end), label, score in zip([*offsets, (0, 0)], [*labels, 0], [*scores, 0.0], strict=True):
            if end > begin and self._labels.get(label, "O") != "O":
                current.append((begin, end, score))
                continue
            if current:
                first, last = current[0][0], current[-1][1]
                mean = sum(s for _, _, s in current) / len(current)
                spans.append(Entity(label="SPAN", score=mean, text=text[first:last], start=first, end=last))
                current = []
        return spans

    def close(self) -> None:
        self._model = None
