"""Group token predictions into entities with character spans: the aggregation of transformers'
``TokenClassificationPipeline``, as pure functions over plain lists.

``aggregation``:

- ``none``: one entity per token (its full label, ``B-PER``), special tokens left out.
- ``simple``: tokens grouped into entities by their tags: a ``B-`` tag, or a change of type, starts a new entity;
  the entity's label is the type (``PER``), its score the mean of its tokens' scores.
- ``first`` / ``max`` / ``average``: word pieces are first joined into words (a piece is a continuation when the
  tokenizer marks it so, e.g. ``##ing``), each word taking the label of its first piece, of its most confident piece,
  or of its pieces' averaged scores; then words are grouped as ``simple`` groups tokens.

Spans are character offsets into the input text (from the fast tokenizer's ``offset_mapping``), and an entity's
``text`` is the input's slice ``text[start:end]``. Labels in ``ignore_labels`` (``O``) are left out at the end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fleet.schemas.construct import built
from fleet.schemas.runtimes import Entity

_ENTITY_FIELDS = frozenset({"label", "score", "text", "start", "end"})


@dataclasses.dataclass(slots=True)
class Piece:
    """One token of one text: its span, its scores over the labels, and whether it continues the previous word."""

    start: int
    end: int
    scores: list[float]
    subword: bool


@dataclasses.dataclass(slots=True)
class Tagged:
    label: str
    score: float
    start: int
    end: int


def argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def tag_of(label: str) -> tuple[str, str]:
    """``("B", "PER")`` for ``B-PER``, ``("I", "PER")`` for ``I-PER``; a label without a prefix counts as ``I``."""
    if label.startswith(("B-", "I-")):
        return label[0], label[2:]
    return "I", label


def tagged(piece: Piece, labels: Sequence[str]) -> Tagged:
    best = argmax(piece.scores)
    return Tagged(labels[best], piece.scores[best], piece.start, piece.end)


def words(pieces: Sequence[Piece]) -> list[list[Piece]]:
    """Pieces joined into words: a piece that is not a continuation starts a new word."""
    out: list[list[Piece]] = []
    for piece in pieces:
        if piece.subword and out:
            out[-1].append(piece)
        else:
            out.append([piece])
    return out


def word_tag(word: Sequence[Piece], labels: Sequence[str], how: str) -> Tagged:
    """One word's label from its pieces: the first's, the most confident one's, or the averaged scores'."""
    if how == "first":
        scores = word[0].scores
    elif how == "max":
        scores = max(word, key=lambda p: max(p.scores)).scores
    else:
        scores = [sum(col) / len(word) for col in zip(*(p.scores for p in word), strict=True)]
    best = argmax(scores)
    return Tagged(labels[best], scores[best], word[0].start, word[-1].end)


def grouped(items: Sequence[Tagged]) -> list[Tagged]:
    """Consecutive items of one type, not restarted by a ``B-`` tag, as one entity labelled with the type."""
    groups: list[list[Tagged]] = []
    for item in items:
        bi, kind = tag_of(item.label)
        if groups and bi != "B" and tag_of(groups[-1][-1].label)[1] == kind:
            groups[-1].append(item)
        else:
            groups.append([item])
    return [
        Tagged(g[0].label.split("-", 1)[-1], sum(t.score for t in g) / len(g), g[0].start, g[-1].end) for g in groups
    ]


def entities(
    text: str, pieces: Sequence[Piece], labels: Sequence[str], aggregation: str, ignore: Sequence[str]
) -> list[Entity]:
    """The entities of one text, in text order."""
    if aggregation in ("none", "simple"):
        items = [tagged(p, labels) for p in pieces]
    else:
        items = [word_tag(w, labels, aggregation) for w in words(pieces)]
    if aggregation != "none":
        items = grouped(items)
    fields = set(_ENTITY_FIELDS)
    return [  # built, not validated: every value was just computed (a random model tags most tokens)
        built(
            Entity,
            {"label": t.label, "score": t.score, "text": text[t.start : t.end], "start": t.start, "end": t.end},
            fields,
        )
        for t in items
        if t.label not in ignore
    ]
