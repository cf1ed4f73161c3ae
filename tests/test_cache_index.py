"""The L3 index without the model: exact search, the switch to IVF, eviction at the bound, forgetting, the guard;
and the parsing of FLEET_CACHE."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from fleet.errors import ConfigError
from fleet.settings import FleetSettings
from producers.gateway.cache import resolve_levels
from producers.gateway.semantic_index import SemanticIndex, default_nlist, texts_agree
from schemas.models import BUILTIN_SPECS

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
