"""The ``rerank`` runtime: a cross-encoder scores a query against each passage; the passages come back best first.

The model is a sequence classifier with one logit, read on each (query, passage) pair; the score is that logit
through a sigmoid (0..1, the scale TEI's ``/rerank`` answers in). ``top_n`` keeps the best N, ``return_text``
returns each passage's text beside its index. Every pair of every job of a micro-batch shares the token-sorted
forward passes of ``fleet.consumers.runtimes.passes``.
"""

from __future__ import annotations

from typing import Any

from fleet.consumers.runtimes.base import RuntimeHandler
from fleet.consumers.runtimes.passes import estimate_tokens, job_slices, sorted_passes
from fleet.errors import ConfigError
from fleet.schemas.runtimes import RerankInput, RerankOutput, RerankResult


class RerankRuntime(RuntimeHandler):
    """``results``: ``{index, score, text?}`` per passage, best first."""

    auto_class = "AutoModelForSequenceClassification"

    def after_load(self) -> None:
        labels = int(self.model.config.num_labels)
        if labels != 1:
            raise ConfigError(
                f"model {self.entry.ref}: a rerank model is a cross-encoder with one output (num_labels: 1); "
                f"this one has {labels}: serve it with the classification runtime"
            )

    def pair_scores(self, queries: list[str], passages: list[str]) -> tuple[list[float], list[int]]:
        """The sigmoid of the logit of each (query, passage) pair, in order, and each pair's tokens."""
        import torch

        model, _ = self.loaded()
        enc = self.encode(queries, passages)
        ids: list[list[int]] = enc["input_ids"]
        scores = [0.0] * len(ids)
        with torch.inference_mode():
            for rows in sorted_passes(ids, self.max_tokens_per_forward or 8192):
                logits = model(**self.forward_inputs(enc, rows)).logits.to(torch.float32)[:, 0]
                for row, s in zip(rows, torch.sigmoid(logits).cpu().tolist(), strict=True):
                    scores[row] = s
        return scores, [len(row) for row in ids]

    def predict(self, batch: list[RerankInput]) -> list[Any]:
        queries = [item.query for item in batch for _ in item.texts]
        passages = [text for item in batch for text in item.texts]
        scores, tokens = self.pair_scores(queries, passages)
        outputs: list[Any] = []
        for item, rows in zip(batch, job_slices([len(item.texts) for item in batch]), strict=True):
            job = scores[rows]
            order = sorted(range(len(job)), key=lambda j: -job[j])[: item.top_n or len(job)]
            results = [
                RerankResult.model_construct(index=j, score=job[j], text=item.texts[j] if item.return_text else None)
                for j in order
            ]
            outputs.append(RerankOutput.model_construct(results=results, tokens=sum(tokens[rows])))
        return outputs

    def cost(self, item: RerankInput) -> int:  # type: ignore[override]
        """Estimated tokens of every (query, passage) pair: both texts and three special tokens, truncated."""
        cap, query = self.max_seq_tokens, len(item.query)
        return sum(estimate_tokens(query + len(text), cap, specials=3) for text in item.texts)

    def sample_input(self) -> RerankInput:
        return RerankInput(query="what is fleet?", texts=["Fleet serves models.", "ok " * 40])
