"""The ``token-classification`` runtime: named entities (or any token tags) with character spans.

A token-classification model (``AutoModelForTokenClassification``) scores every token over the labels of
``config.json``'s ``id2label`` (softmax); ``fleet.consumers.runtimes.entities`` groups the tokens into entities the
way transformers' pipeline does (``aggregation``: ``none``, ``simple``, ``first``, ``max``, ``average``), with
character offsets from the fast tokenizer's ``offset_mapping``. Labels in ``options.ignore_labels`` are not reported.

``options.prompt`` is read before every text, as the first segment of a pair (``[CLS] prompt [SEP] text [SEP]``
for BERT-like tokenizers): the schema that zero-shot extractors such as RexUniNLU and UIE read with each text. Its
tokens count as special tokens (never tagged, never in a span); only the text is truncated; the ``tokens`` of an
output count them, since the model read them.
"""

from __future__ import annotations

from typing import Any

from fleet.consumers.runtimes.base import RuntimeHandler
from fleet.consumers.runtimes.entities import Piece, entities
from fleet.consumers.runtimes.passes import flatten, job_slices, sorted_passes
from fleet.errors import ConfigError
from fleet.schemas.runtimes import Entity, TokenClassificationInput, TokenClassificationOutput


class TokenClassificationRuntime(RuntimeHandler):
    """``entities`` for a ``text``, ``results`` (one list per text) for ``texts``."""

    auto_class = "AutoModelForTokenClassification"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.labels: list[str] = []
        self.word_pieces = False  # the tokenizer marks continuations (``##``), so a word's pieces are known

    def after_load(self) -> None:
        if not getattr(self.tokenizer, "is_fast", False):
            raise ConfigError(f"model {self.entry.ref}: token-classification needs a fast tokenizer (tokenizer.json)")
        config = self.model.config
        self.labels = [str(config.id2label[i]) for i in range(int(config.num_labels))]
        backend = getattr(self.tokenizer, "backend_tokenizer", None) or getattr(self.tokenizer, "_tokenizer", None)
        self.word_pieces = bool(getattr(getattr(backend, "model", None), "continuing_subword_prefix", None))
        prompt = self.options.prompt
        if prompt is not None:
            alone = len(self.tokenizer("a")["input_ids"])  # a text of one token: an empty one may lose its separator
            self.prompt_tokens = len(self.tokenizer(prompt, "a")["input_ids"]) - alone
            if self.prompt_tokens + alone >= self.max_seq_tokens:
                raise ConfigError(
                    f"model {self.entry.ref}: options.prompt takes {self.prompt_tokens} tokens, leaving none of the "
                    f"{self.max_seq_tokens} the model reads for the text"
                )

    def encode_texts(self, texts: list[str]) -> dict[str, Any]:
        """Token ids, offsets and special-token masks of the texts, each after the prompt when there is one (its
        tokens then marked special: ``pieces`` leaves them out)."""
        prompt = self.options.prompt
        if prompt is None:
            return self.encode(texts, offsets=True)
        enc = self.encode([prompt] * len(texts), texts, offsets=True, truncation="only_second")
        enc["special_tokens_mask"] = [[int(segment != 1) for segment in row] for row in enc["sequence_ids"]]
        return enc

    def token_scores(self, texts: list[str]) -> tuple[dict[str, Any], list[list[list[float]]]]:
        """The encoding of each text and, per text, each token's probabilities over the labels."""
        import torch

        model, _ = self.loaded()
        enc = self.encode_texts(texts)
        ids: list[list[int]] = enc["input_ids"]
        probs: list[list[list[float]]] = [[] for _ in ids]
        with torch.inference_mode():
            for rows in sorted_passes(ids, self.max_tokens_per_forward or 8192):
                logits = model(**self.forward_inputs(enc, rows)).logits.to(torch.float32)
                values = torch.softmax(logits, dim=-1).cpu().tolist()
                for row, p in zip(rows, values, strict=True):
                    probs[row] = p[: len(ids[row])]
        return enc, probs

    def pieces(self, text: str, enc: dict[str, Any], row: int, probs: list[list[float]]) -> list[Piece]:
        """The text's real tokens (special tokens left out) with their spans and scores."""
        ids, special = enc["input_ids"][row], enc["special_tokens_mask"][row]
        tokens = self.tokenizer.convert_ids_to_tokens(ids)
        unk = self.tokenizer.unk_token_id
        out = []
        for j, (start, end) in enumerate(enc["offset_mapping"][row]):
            if special[j]:
                continue
            if ids[j] == unk:
                subword = False
            elif self.word_pieces:
                subword = len(tokens[j]) != end - start
            else:  # no continuation marker: a piece glued to the previous character continues its word
                subword = start > 0 and " " not in text[start - 1 : start + 1]
            out.append(Piece(start, end, probs[j], subword))
        return out

    def predict(self, batch: list[TokenClassificationInput]) -> list[Any]:
        texts, counts = flatten([item.items() for item in batch])
        enc, probs = self.token_scores(texts)
        ignore = self.options.ignore_labels
        outputs: list[Any] = []
        for item, rows in zip(batch, job_slices(counts), strict=True):
            how = item.aggregation or self.options.aggregation
            found: list[list[Entity]] = [
                entities(texts[r], self.pieces(texts[r], enc, r, probs[r]), self.labels, how, ignore)
                for r in range(rows.start, rows.stop)
            ]
            used = sum(len(enc["input_ids"][r]) for r in range(rows.start, rows.stop))
            if item.text is not None:
                outputs.append(TokenClassificationOutput.model_construct(entities=found[0], tokens=used))
            else:
                outputs.append(TokenClassificationOutput.model_construct(results=found, tokens=used))
        return outputs

    def output_json(self, output: TokenClassificationOutput, encoding: str = "float") -> Any:
        """``model_dump(mode="json")``'s answer, written out: a text can hold dozens of entities, and dumping each
        through pydantic cost a tenth of the model's time on a small model."""
        return {
            "entities": None if output.entities is None else [_entity_json(e) for e in output.entities],
            "results": None if output.results is None else [[_entity_json(e) for e in r] for r in output.results],
            "tokens": output.tokens,
        }

    def sample_input(self) -> TokenClassificationInput:
        return TokenClassificationInput(texts=["Ada Lovelace lived in London.", "Fleet " * 40, "ok"])


def _entity_json(entity: Entity) -> dict[str, Any]:
    return {"label": entity.label, "score": entity.score, "text": entity.text, "start": entity.start, "end": entity.end}
