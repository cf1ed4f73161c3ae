"""The per-runtime agreement measures, by tables: cosine (float and base64 vectors), top label, span F1, top-1
rerank, exact equality, list outputs, and outputs that are not the runtime's."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet.encoding import encode_vector
from fleet.lifecycle.compare import MEASURES, agreement, cosine, span_f1
from fleet.schemas.runtimes import RUNTIME_SCHEMAS


def ent(label: str, start: int, end: int) -> dict[str, Any]:
    return {"label": label, "score": 0.9, "text": "x" * (end - start), "start": start, "end": end}


def lab(*labels: str) -> list[dict[str, Any]]:
    return [{"label": name, "score": 1.0 / (i + 1)} for i, name in enumerate(labels)]


def test_every_runtime_has_a_measure() -> None:
    assert set(MEASURES) == set(RUNTIME_SCHEMAS)


# -- embeddings -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("primary", "shadow", "expected"),
    [
        ({"dim": 2, "embedding": [1.0, 0.0]}, {"dim": 2, "embedding": [2.0, 0.0]}, 1.0),
        ({"dim": 2, "embedding": [1.0, 0.0]}, {"dim": 2, "embedding": [0.0, 1.0]}, 0.0),
        ({"dim": 2, "embedding": [1.0, 0.0]}, {"dim": 2, "embedding": [1.0, 1.0]}, 0.5**0.5),
        ({"dim": 2, "embedding": [1.0, 0.0]}, {"dim": 2, "embedding": [-1.0, 0.0]}, 0.0),
        ({"dim": 2, "embedding": [0.0, 0.0]}, {"dim": 2, "embedding": [0.0, 0.0]}, 1.0),
        ({"dim": 2, "embedding": [0.0, 0.0]}, {"dim": 2, "embedding": [1.0, 0.0]}, 0.0),
        ({"dim": 2, "embedding": [1.0, 0.0]}, {"dim": 3, "embedding": [1.0, 0.0, 0.0]}, 0.0),
        ({"dim": 2, "embeddings": [[1, 0], [0, 1]]}, {"dim": 2, "embeddings": [[1, 0], [1, 0]]}, 0.5),
        ({"dim": 2, "embeddings": [[1, 0], [0, 1]]}, {"dim": 2, "embeddings": [[1, 0]]}, 0.5),
        ({"dim": 2, "embedding": [1.0, 0.0]}, {"dim": 2, "embeddings": [[1.0, 0.0]]}, 0.0),
        ({"dim": 2, "embedding": [1.0, 0.0], "tokens": 3}, {"dim": 2, "embedding": [1.0, 0.0], "tokens": 4}, 1.0),
    ],
    ids=[
        "same-direction",
        "orthogonal",
        "45-degrees",
        "opposite-floored-at-zero",
        "both-zero",
        "one-zero",
        "different-lengths",
        "list-mean",
        "missing-text-scores-zero",
        "single-against-list",
        "token-counts-ignored",
    ],
)
def test_embeddings(primary: dict[str, Any], shadow: dict[str, Any], expected: float) -> None:
    assert agreement("embeddings", primary, shadow) == pytest.approx(expected)


def test_base64_vectors_compare_with_float_ones() -> None:
    floats = {"dim": 3, "embeddings": [[0.1, 0.2, 0.3], [1.0, 0.0, 0.0]]}
    packed = {"dim": 3, "embeddings": [encode_vector([0.1, 0.2, 0.3]), encode_vector([0.0, 1.0, 0.0])]}
    assert agreement("embeddings", floats, packed) == pytest.approx(0.5)
    one = {"dim": 3, "embedding": str(encode_vector([0.3, 0.2, 0.1]))}
    assert agreement("embeddings", one, {"dim": 3, "embedding": [0.3, 0.2, 0.1]}) == pytest.approx(1.0)


@given(
    st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=16).flatmap(
        lambda a: st.tuples(st.just(a), st.lists(st.floats(-1e3, 1e3), min_size=len(a), max_size=len(a)))
    )
)
def test_cosine_is_symmetric_and_in_the_unit_interval(vectors: tuple[list[float], list[float]]) -> None:
    a, b = vectors
    value = cosine(a, b)
    assert 0.0 <= value <= 1.0
    assert value == pytest.approx(cosine(b, a))


# -- classification -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("primary", "shadow", "expected"),
    [
        ({"labels": lab("pos", "neg")}, {"labels": lab("pos")}, 1.0),
        ({"labels": lab("pos", "neg")}, {"labels": lab("neg", "pos")}, 0.0),
        ({"labels": []}, {"labels": []}, 1.0),
        ({"labels": []}, {"labels": lab("pos")}, 0.0),
        (
            {"results": [lab("a"), lab("b"), lab("c"), lab("d")]},
            {"results": [lab("a"), lab("b"), lab("x"), lab("d")]},
            0.75,
        ),
        ({"results": []}, {"results": []}, 1.0),
    ],
    ids=["same-top", "top-swapped", "both-empty", "one-empty", "three-of-four-texts", "no-texts"],
)
def test_classification(primary: dict[str, Any], shadow: dict[str, Any], expected: float) -> None:
    assert agreement("classification", primary, shadow) == pytest.approx(expected)


# -- token classification -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("primary", "shadow", "expected"),
    [
        ({"entities": []}, {"entities": []}, 1.0),
        ({"entities": [ent("PER", 0, 4)]}, {"entities": []}, 0.0),
        ({"entities": [ent("PER", 0, 4)]}, {"entities": [ent("PER", 0, 4)]}, 1.0),
        ({"entities": [ent("PER", 0, 4)]}, {"entities": [ent("ORG", 0, 4)]}, 0.0),
        ({"entities": [ent("PER", 0, 4)]}, {"entities": [ent("PER", 0, 5)]}, 0.0),
        ({"entities": [ent("PER", 0, 4), ent("LOC", 9, 14)]}, {"entities": [ent("PER", 0, 4)]}, 2 / 3),
        (
            {"entities": [ent("PER", 0, 4), ent("LOC", 9, 14)]},
            {"entities": [ent("PER", 0, 4), ent("ORG", 20, 23)]},
            0.5,
        ),
        ({"results": [[], [ent("PER", 0, 4)]]}, {"results": [[], [ent("PER", 0, 4)]]}, 1.0),
        ({"results": [[], [ent("PER", 0, 4)]]}, {"results": [[ent("PER", 0, 4)], [ent("PER", 0, 4)]]}, 0.5),
    ],
    ids=[
        "both-empty",
        "one-empty",
        "same-span",
        "other-label",
        "other-end",
        "one-of-two",
        "one-of-two-each",
        "texts-all-same",
        "texts-one-differs",
    ],
)
def test_token_classification(primary: dict[str, Any], shadow: dict[str, Any], expected: float) -> None:
    assert agreement("token-classification", primary, shadow) == pytest.approx(expected)


@given(st.sets(st.tuples(st.sampled_from("AB"), st.integers(0, 5), st.integers(0, 5))), st.data())
def test_span_f1_is_one_exactly_for_equal_sets(a: set[tuple[str, int, int]], data: st.DataObject) -> None:
    b = data.draw(st.sets(st.tuples(st.sampled_from("AB"), st.integers(0, 5), st.integers(0, 5))))
    value = span_f1(a, b)
    assert 0.0 <= value <= 1.0
    assert (value == 1.0) == (a == b)


# -- rerank ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("primary", "shadow", "expected"),
    [
        ([2, 0, 1], [2, 1, 0], 1.0),
        ([2, 0, 1], [0, 2, 1], 0.0),
        ([], [], 1.0),
    ],
    ids=["same-best", "other-best", "both-empty"],
)
def test_rerank(primary: list[int], shadow: list[int], expected: float) -> None:
    def out(order: list[int]) -> dict[str, Any]:
        return {"results": [{"index": i, "score": 1.0 - n / 10} for n, i in enumerate(order)]}

    assert agreement("rerank", out(primary), out(shadow)) == expected


# -- anything else --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("runtime", "primary", "shadow", "expected"),
    [
        (None, {"answer": 42}, {"answer": 42}, 1.0),
        (None, {"answer": 42}, {"answer": 43}, 0.0),
        ("my-handler", {"a": [1, {"b": 2}]}, {"a": [1, {"b": 2}]}, 1.0),
        ("my-handler", {"a": 1, "b": 2}, {"b": 2, "a": 1}, 1.0),
        ("my-handler", {"a": 1.0}, {"a": 1.0000001}, 0.0),
    ],
    ids=["equal", "different", "nested", "key-order-ignored", "floats-exact"],
)
def test_exact(runtime: str | None, primary: dict[str, Any], shadow: dict[str, Any], expected: float) -> None:
    assert agreement(runtime, primary, shadow) == expected


# -- not the runtime's output ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("runtime", "output", "message"),
    [
        ("embeddings", {"dim": 2}, "neither 'embedding' nor 'embeddings'"),
        ("embeddings", {"dim": 2, "embedding": ["a", "b"]}, "a vector is a list of numbers"),
        ("embeddings", {"dim": 2, "embedding": "not base64!"}, "not a base64 vector"),
        ("classification", {"labels": [{"score": 1.0}]}, "each item needs 'label'"),
        ("token-classification", {"entities": [{"label": "PER"}]}, "an entity needs label, start and end"),
        ("rerank", {"ranked": []}, "the output has no 'results'"),
        ("classification", ["pos"], "an output is a JSON object"),
    ],
    ids=["no-vector", "vector-of-strings", "bad-base64", "label-missing", "span-missing", "no-results", "not-a-dict"],
)
def test_an_output_not_of_the_runtimes_shape_raises(runtime: str, output: Any, message: str) -> None:
    good: dict[str, dict[str, Any]] = {
        "embeddings": {"dim": 2, "embedding": [1.0, 0.0]},
        "classification": {"labels": lab("pos")},
        "token-classification": {"entities": []},
        "rerank": {"results": [{"index": 0, "score": 0.5}]},
    }
    with pytest.raises(ValueError, match=message):
        agreement(runtime, good[runtime], output)
