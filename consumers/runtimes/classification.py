"""The ``classification`` runtime: labels and scores per text from a sequence-classification model.

Labels come from ``config.json``'s ``id2label``. Scores are a softmax over the labels, or independent sigmoids for a
multi-label model (``options.multi_label``, else ``config.problem_type == "multi_label_classification"``). Each text
answers its ``top_k`` best labels (the request's, else ``options.top_k``; ``0``: every label), best first.
"""

from __future__ import annotations

from typing import Any

from fleet.consumers.runtimes.base import RuntimeHandler
from fleet.consumers.runtimes.passes import flatten, job_slices, sorted_passes
from fleet.schemas.runtimes import ClassificationInput, ClassificationOutput, LabelScore


def ranked(scores: list[float], labels: list[str], top_k: int) -> list[LabelScore]:
    """The labels best first (ties in label order), the first ``top_k`` of them (``0``: all)."""
    order = sorted(range(len(scores)), key=lambda j: -scores[j])
    if top_k:
        order = order[:top_k]
    return [LabelScore.model_construct(label=labels[j], score=scores[j]) for j in order]


class ClassificationRuntime(RuntimeHandler):
    """``labels`` for a ``text``, ``results`` (one list per text) for ``texts``."""

    auto_class = "AutoModelForSequenceClassification"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.labels: list[str] = []
        self.multi_label = bool(self.options.multi_label)

    def after_load(self) -> None:
        config = self.model.config
        self.labels = [str(config.id2label[i]) for i in range(int(config.num_labels))]
        if self.options.multi_label is None:
            self.multi_label = config.problem_type == "multi_label_classification"

    def scores(self, texts: list[str], pairs: list[str] | None = None) -> tuple[list[list[float]], list[int]]:
        """Probabilities per text (softmax, or sigmoid when multi-label), in order, and each text's tokens."""
        import torch

        model, _ = self.loaded()
        enc = self.encode(texts, pairs)
        ids: list[list[int]] = enc["input_ids"]
        probs: list[list[float]] = [[] for _ in ids]
        with torch.inference_mode():
            for rows in sorted_passes(ids, self.max_tokens_per_forward or 8192):
                logits = model(**self.forward_inputs(enc, rows)).logits.to(torch.float32)
                values = torch.sigmoid(logits) if self.multi_label else torch.softmax(logits, dim=-1)
                for row, p in zip(rows, values.cpu().tolist(), strict=True):
                    probs[row] = p
        return probs, [len(row) for row in ids]

    def predict(self, batch: list[ClassificationInput]) -> list[Any]:
        texts, counts = flatten([item.items() for item in batch])
        probs, tokens = self.scores(texts)
        outputs: list[Any] = []
        for item, rows in zip(batch, job_slices(counts), strict=True):
            top_k = self.options.top_k if item.top_k is None else item.top_k
            results = [ranked(p, self.labels, top_k) for p in probs[rows]]
            used = sum(tokens[rows])
            if item.text is not None:
                outputs.append(ClassificationOutput.model_construct(labels=results[0], tokens=used))
            else:
                outputs.append(ClassificationOutput.model_construct(results=results, tokens=used))
        return outputs

    def sample_input(self) -> ClassificationInput:
        return ClassificationInput(texts=["A short warm-up sentence.", "Fleet " * 40, "ok"])
