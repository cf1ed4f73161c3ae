"""How much a shadow version's output agrees with the primary's, per runtime, as a number in 0..1 (1: the same).

``agreement(runtime, primary, shadow)`` takes two outputs in the shapes of ``fleet.schemas.runtimes`` (JSON dicts,
as stored in a job record) and applies the runtime's measure:

- ``embeddings``: cosine similarity of the vectors, negative values counted as 0; ``embedding`` (one vector) or
  ``embeddings`` (one per text, averaged). Base64 vectors (``encoding_format: base64``) are decoded with
  ``fleet.encoding.decode_vector``, so either encoding compares. Two zero vectors agree (1), a zero vector and
  another do not (0), vectors of different lengths do not (0).
- ``classification``: the top label of each text is the same (1) or not (0); ``labels`` or ``results``.
- ``token-classification``: F1 of the sets of entity spans ``(label, start, end)``; ``entities`` or ``results``.
  Both sides finding nothing is full agreement (1).
- ``rerank``: the best passage (``results[0].index``) is the same (1) or not (0).
- anything else (a user's handler): exact equality of the whole output (1 or 0).

A list output (``texts`` input) scores the mean over its texts; a text one side answered and the other did not
scores 0 (lists of different lengths), and one side answering for ``text`` and the other for ``texts`` scores 0.
A missing or malformed field raises ``ValueError`` (the output is not the runtime's: a bug, not a disagreement).
``tokens`` is never compared: a new version may count tokens differently and still answer the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from fleet.encoding import decode_vector

Measure = Callable[[dict[str, Any], dict[str, Any]], float]


def agreement(runtime: str | None, primary: dict[str, Any], shadow: dict[str, Any]) -> float:
    """The agreement in 0..1 of ``shadow`` with ``primary`` under ``runtime``'s measure (exact equality for a
    runtime without one, or ``None``: a user's handler). Raises ``ValueError`` for an output not of the runtime's
    shape."""
    measure = MEASURES.get(runtime or "", exact)
    return measure(primary, shadow)


def exact(primary: Any, shadow: Any) -> float:
    """1 when the two outputs are equal JSON values, else 0."""
    return 1.0 if primary == shadow else 0.0


# -- embeddings -----------------------------------------------------------------------------------------------
def embeddings(primary: dict[str, Any], shadow: dict[str, Any]) -> float:
    """Cosine similarity (floored at 0) of ``embedding``, or the mean over ``embeddings``."""
    return _per_text(primary, shadow, "embedding", "embeddings", _vector_agreement)


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two vectors of the same length, floored at 0; two zero vectors are the same (1)."""
    if len(a) != len(b):
        return 0.0
    norm_a = math.sqrt(math.fsum(x * x for x in a))
    norm_b = math.sqrt(math.fsum(x * x for x in b))
    if norm_a == 0.0 or norm_b == 0.0:
        return 1.0 if norm_a == norm_b else 0.0
    value = math.fsum(x * y for x, y in zip(a, b, strict=True)) / (norm_a * norm_b)
    return min(1.0, max(0.0, value))


def _vector_agreement(a: Any, b: Any) -> float:
    return cosine(_vector(a), _vector(b))


def _vector(value: Any) -> list[float]:
    if isinstance(value, str):
        return decode_vector(value)
    if isinstance(value, list) and all(isinstance(x, int | float) and not isinstance(x, bool) for x in value):
        return [float(x) for x in value]
    raise ValueError(f"a vector is a list of numbers or a base64 string, got {type(value).__name__}")


# -- classification -------------------------------------------------------------------------------------------
def classification(primary: dict[str, Any], shadow: dict[str, Any]) -> float:
    """The share of texts whose top label is the same."""
    return _per_text(primary, shadow, "labels", "results", _top_label_agreement)


def _top_label_agreement(a: Any, b: Any) -> float:
    top_a, top_b = _first(a, "label"), _first(b, "label")
    return 1.0 if top_a == top_b else 0.0


# -- token classification -------------------------------------------------------------------------------------
def token_classification(primary: dict[str, Any], shadow: dict[str, Any]) -> float:
    """F1 of the entity spans ``(label, start, end)``, the mean over texts; nothing found on both sides is 1."""
    return _per_text(primary, shadow, "entities", "results", _span_f1)


def span_f1(a: set[tuple[str, int, int]], b: set[tuple[str, int, int]]) -> float:
    """F1 of two sets of spans: 2 |a & b| / (|a| + |b|); 1 when both are empty."""
    if not a and not b:
        return 1.0
    return 2 * len(a & b) / (len(a) + len(b))


def _span_f1(a: Any, b: Any) -> float:
    return span_f1(_spans(a), _spans(b))


def _spans(entities: Any) -> set[tuple[str, int, int]]:
    if not isinstance(entities, list):
        raise ValueError(f"entities are a list, got {type(entities).__name__}")
    try:
        return {(str(e["label"]), int(e["start"]), int(e["end"])) for e in entities}
    except (KeyError, TypeError) as exc:
        raise ValueError(f"an entity needs label, start and end: {exc}") from None


# -- rerank ---------------------------------------------------------------------------------------------------
def rerank(primary: dict[str, Any], shadow: dict[str, Any]) -> float:
    """1 when both rank the same passage first (or both rank none), else 0."""
    return 1.0 if _first(_field(primary, "results"), "index") == _first(_field(shadow, "results"), "index") else 0.0


# -- shared ---------------------------------------------------------------------------------------------------
def _per_text(
    primary: dict[str, Any], shadow: dict[str, Any], one: str, many: str, measure: Callable[[Any, Any], float]
) -> float:
    shape_p, shape_s = _shape(primary, one, many), _shape(shadow, one, many)
    if shape_p != shape_s:
        return 0.0  # one answered a single text, the other a list
    if shape_p == one:
        return measure(primary[one], shadow[one])
    items_p, items_s = _field(primary, many), _field(shadow, many)
    if not isinstance(items_p, list) or not isinstance(items_s, list):
        raise ValueError(f"{many!r} is a list")
    if not items_p and not items_s:
        return 1.0
    paired = sum(measure(a, b) for a, b in zip(items_p, items_s, strict=False))
    return paired / max(len(items_p), len(items_s))  # a text only one side answered scores 0


def _shape(output: dict[str, Any], one: str, many: str) -> str:
    if not isinstance(output, dict):
        raise ValueError(f"an output is a JSON object, got {type(output).__name__}")
    if output.get(one) is not None:
        return one
    if output.get(many) is not None:
        return many
    raise ValueError(f"the output has neither {one!r} nor {many!r}")


def _field(output: dict[str, Any], name: str) -> Any:
    if not isinstance(output, dict) or name not in output:
        raise ValueError(f"the output has no {name!r}")
    return output[name]


def _first(items: Any, key: str) -> Any:
    """``items[0][key]``, or None for an empty list."""
    if not isinstance(items, list):
        raise ValueError(f"expected a list, got {type(items).__name__}")
    if not items:
        return None
    first = items[0]
    if not isinstance(first, dict) or key not in first:
        raise ValueError(f"each item needs {key!r}")
    return first[key]


MEASURES: dict[str, Measure] = {
    "embeddings": embeddings,
    "classification": classification,
    "token-classification": token_classification,
    "rerank": rerank,
}
