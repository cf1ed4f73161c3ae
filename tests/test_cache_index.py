"""The L3 index without the model: exact search, the switch to IVF, eviction at the bound, forgetting, the guard;
and the parsing of FLEET_CACHE."""

from __future__ import annotations

import faiss
import numpy as np
import pytest
from pydantic import ValidationError

from fleet.errors import ConfigError
from fleet.producers.gateway.cache.results import resolve_levels
from fleet.producers.gateway.cache.semantic_index import (
    SemanticIndex,
    default_nlist,
    faiss_gpus,
    index_device,
    texts_agree,
)
from fleet.schemas.models import BUILTIN_SPECS
from fleet.settings import FleetSettings

DIM = 32


def unit(rows: int, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((rows, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def near(x: np.ndarray, noise: float = 0.05, seed: int = 1) -> np.ndarray:
    y = x + noise * np.random.default_rng(seed).standard_normal(x.shape).astype(np.float32)
    return y / np.linalg.norm(y, axis=1, keepdims=True)


def filled(rows: int, **options: int) -> tuple[SemanticIndex, np.ndarray]:
    x = unit(rows)
    index = SemanticIndex(DIM, **{"max_entries": 10_000, **options})
    for start in range(0, rows, 500):
        stop = min(start + 500, rows)
        index.add(x[start:stop], [f"k{i}" for i in range(start, stop)], ["same text"] * (stop - start))
    return index, x


def keys(matches: list[object]) -> list[str | None]:
    return [getattr(m, "key", None) for m in matches]


def test_flat_index_finds_the_nearest_entry_above_the_threshold() -> None:
    index, x = filled(200)
    assert not index.trained
    matches = index.search(near(x[:50]), ["same text"] * 50, 0.9)
    assert keys(matches) == [f"k{i}" for i in range(50)]
    assert all(m is not None and 0.9 <= m.similarity <= 1.0 for m in matches)
    far = unit(5, seed=7)  # random directions: similarity near 0
    assert index.search(far, ["same text"] * 5, 0.9) == [None] * 5


def test_index_trains_ivf_at_its_size_and_still_finds_near_duplicates() -> None:
    index, x = filled(3000, train_at=2048, nprobe=8)
    assert index.trained and len(index) == 3000
    found = keys(index.search(near(x[::10]), ["same text"] * 300, 0.9))
    assert sum(k == f"k{i * 10}" for i, k in enumerate(found)) >= 297  # IVF may lose a rare boundary case


def test_the_oldest_entries_are_evicted_in_one_batch_past_the_bound() -> None:
    index, x = filled(1200, max_entries=1000, train_at=512)
    assert len(index) <= 1000 and len(index) >= 950
    assert "k0" not in index and "k1199" in index
    assert index.search(x[:1], ["same text"], 0.99) == [None]  # evicted vectors never answer
    assert keys(index.search(x[1199:], ["same text"], 0.99)) == ["k1199"]


def test_a_forgotten_entry_no_longer_answers_and_keys_are_added_once() -> None:
    index, x = filled(10)
    index.discard("k3")
    assert index.search(x[3:4], ["same text"], 0.99) == [None]
    assert index.add(x[:2], ["k0", "k1"], ["same text"] * 2) == 0  # known keys: nothing added twice
    assert index.add(x[3:4], ["k3"], ["same text"]) == 1


def test_a_mirrored_index_answers_as_the_index_through_adds_training_and_evictions() -> None:
    """Searches on a copy (a GPU's where FAISS has one; here FAISS's own CPU clone, the same code path): adds reach
    the copy, and it is made again only after what a GPU index cannot do in place (removals, the move to IVF)."""
    copies: list[faiss.Index] = []

    def mirror(index: faiss.Index) -> faiss.Index:
        copies.append(faiss.clone_index(index))
        return copies[-1]

    plain = SemanticIndex(DIM, max_entries=1000, train_at=512)
    mirrored = SemanticIndex(DIM, max_entries=1000, train_at=512, mirror=mirror)
    x = unit(1200)

    def same_answers(rows: slice) -> list[str | None]:
        texts = ["same text"] * len(x[rows])
        expected = keys(plain.search(near(x[rows]), texts, 0.9))
        assert keys(mirrored.search(near(x[rows]), texts, 0.9)) == expected
        return expected

    for start in range(0, 400, 100):  # flat: one copy, made at the first search, then kept in step by the adds
        for index in (plain, mirrored):
            index.add(x[start : start + 100], [f"k{i}" for i in range(start, start + 100)], ["same text"] * 100)
        assert same_answers(slice(0, start + 100)) == [f"k{i}" for i in range(start + 100)]
    assert len(copies) == 1 and copies[0].ntotal == 400
    for index in (plain, mirrored):  # past train_at: the move to IVF makes a new copy
        index.add(x[400:600], [f"k{i}" for i in range(400, 600)], ["same text"] * 200)
    assert mirrored.trained
    same_answers(slice(0, 600))
    assert len(copies) == 2
    for index in (plain, mirrored):  # past the bound: a batch eviction, then a new copy without the evicted
        index.add(x[600:1200], [f"k{i}" for i in range(600, 1200)], ["same text"] * 600)
    assert mirrored.search(x[:1], ["same text"], 0.99) == [None]
    same_answers(slice(0, 1200))
    assert len(copies) == 3 and copies[-1].ntotal == len(mirrored)
    mirrored.discard("k1199")  # forgetting alone touches no index: still skipped
    assert mirrored.search(x[1199:], ["same text"], 0.99) == [None] and len(copies) == 3


def test_the_index_device_follows_the_model_setting() -> None:
    assert index_device("cpu") is None
    assert index_device("auto") == (0 if faiss_gpus() else None)  # faiss-cpu, or no GPU: the CPU
    with pytest.raises(ConfigError, match="not supported; use auto, cpu, cuda or cuda:N"):
        index_device("tpu")
    if faiss_gpus() == 0:
        with pytest.raises(ConfigError, match=r"FAISS sees no GPU.*faiss-gpu"):
            index_device("cuda")
    else:
        assert index_device("cuda") == 0
        with pytest.raises(ConfigError, match="does not exist"):
            index_device(f"cuda:{faiss_gpus()}")


def test_a_match_must_agree_on_numbers_and_negations() -> None:
    index = SemanticIndex(DIM, max_entries=100)
    x = unit(1)
    index.add(x, ["k"], ["book 2 tickets for friday"])
    assert keys(index.search(x, ["Book 2 tickets for Friday!"], 0.9)) == ["k"]
    assert index.search(x, ["book 3 tickets for friday"], 0.9) == [None]
    assert index.search(x, ["don't book 2 tickets for friday"], 0.9) == [None]


@pytest.mark.parametrize(
    ("a", "b", "agree"),
    [
        ("Open an account.", "open an account", True),
        ("I can't log in", "I cannot log in", True),
        ("I can log in", "I cannot log in", False),
        ("no sugar please", "sugar please", False),
        ("pay 10.50 now", "pay 10.50 now", True),
        ("pay 10.50 now", "pay 10.05 now", False),
        ("from 3 to 5", "from 5 to 3", False),
        ("move money from savings to checking", "move money from checking to savings", False),
        ("Please help me open my account.", "Help me open my account, please.", True),
        ("Today, how can I pay?", "How can I pay today?", True),
        ("Please help me open my account.", "Please assist me to open my account.", True),
    ],
)
def test_texts_agree(a: str, b: str, agree: bool) -> None:
    assert texts_agree(a, b) is agree


def test_nlist_grows_with_the_bound() -> None:
    assert default_nlist(100) == 32 and default_nlist(100_000) == 1024 and default_nlist(10**9) == 4096


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("embed", {"embed": ("all",)}),
        ("embed=l1+l2+l3,echo=l1", {"embed": ("l1", "l2", "l3"), "echo": ("l1",)}),
        ("echo=l2+l1", {"echo": ("l1", "l2")}),
        ('{"embed": ["l3", "l1"]}', {"embed": ("l1", "l3")}),
        ("", {}),
    ],
)
def test_fleet_cache_forms(value: str, parsed: dict[str, tuple[str, ...]]) -> None:
    assert FleetSettings(cache=value).cache == parsed


@pytest.mark.parametrize(
    ("value", "message"),
    [("embed=l4", "unknown level(s) l4"), ("embed=", "needs levels"), ('{"embed": 3}', "needs levels")],
)
def test_fleet_cache_errors_say_what_is_wrong(value: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        FleetSettings(cache=value)


def test_levels_resolve_against_the_served_specs() -> None:
    specs = dict(BUILTIN_SPECS)
    levels = resolve_levels(FleetSettings(cache="embed,echo"), specs)
    assert levels == {"embed": ("l1", "l2", "l3"), "echo": ("l1", "l2")}
    with pytest.raises(ConfigError, match="cannot use l3"):
        resolve_levels(FleetSettings(cache="echo=l1+l3"), specs)
    with pytest.raises(ConfigError, match="not served"):
        resolve_levels(FleetSettings(cache="nosuch"), specs)
