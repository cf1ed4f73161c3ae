"""The L3 (semantic) cache's nearest-neighbour index: FAISS inner product over L2-normalised vectors.

One ``SemanticIndex`` per model version in each gateway. Below ``train_at`` entries it is exact (a flat index,
searched in well under a millisecond at that size); at ``train_at`` it trains an inverted-file index (``IndexIVFFlat``
with ``nlist`` lists, about ``4 * sqrt(max_entries)``) on the vectors it holds and moves them in, so a query scans
``nprobe`` lists instead of every entry (100,000 entries answer in a fraction of a millisecond on one core).

Size bound and eviction: at most ``max_entries``; past it the oldest entries (insertion order) are removed in one
batch, down to 95 % of the bound, so the O(n) removal is paid once per 5 % of growth. ``discard(key)`` (an entry
whose L2 output expired) only forgets the entry; its vector stays in FAISS until the next batch eviction and is
skipped by ``search``.

Device: the index follows the model's device setting (``FLEET_DEVICE``, ``index_device``). On a GPU (the
``faiss-gpu`` build of FAISS on a CUDA machine) searches run on a GPU copy of the index (``index_cpu_to_gpu``):
adds go to both copies, and the GPU copy is rebuilt from the CPU one after a batch eviction or the move to IVF,
since FAISS's GPU indexes cannot remove ids. The CPU copy stays the source of truth either way.

``texts_agree`` is the guard a match must also pass: the same numbers, the same negations and no swapped roles,
which cosine similarity of mean-pooled embeddings does not separate ("2 tickets" and "3 tickets" embed almost
alike; "from savings to checking" and "from checking to savings" at 0.99).
"""

from __future__ import annotations

import difflib
import math
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fleet.errors import ConfigError

if TYPE_CHECKING:  # FAISS is imported where an index is made: a gateway without an L3 cache never loads it
    import faiss

SEARCH_K = 4  # neighbours read per query, so that forgotten entries and guard failures can be skipped
EVICT_TO = 0.95  # a batch eviction leaves this share of max_entries
NEGATIONS = frozenset({"not", "no", "never", "none", "nobody", "nothing", "nowhere", "neither", "nor", "without"})
ORDER_CHECK_WORDS = 256  # longer texts skip the word-order check (its cost grows with the square of the length)
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_CUDA = re.compile(r"^cuda(?::(\d+))?$")
Mirror = Callable[["faiss.Index"], "faiss.Index"]  # a copy of the CPU index to search on (a GPU's)
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")


@dataclass(frozen=True, slots=True)
class Match:
    """The nearest earlier request that passed the threshold and the guard."""

    key: str
    text: str
    similarity: float


def _negations(text: str) -> frozenset[str]:
    words = _WORD.findall(text.lower())
    found = {w for w in words if w in NEGATIONS}
    if any(w.endswith("n't") for w in words) or "cannot" in words:
        found.add("not")
    return frozenset(found)


def _one_move(a: list[str], b: list[str]) -> bool:
    """True unless words shared by ``a`` and ``b`` changed places other than as one phrase moved to or from an end.

    The edit script from ``a`` to ``b`` (``difflib``) leaves some words unmatched; those present on both sides
    moved. A paraphrase moves one phrase between the start and the end ("Please help me..." / "Help me...,
    please"; "Today, how..." / "How... today?"); swapped roles move a phrase inside the sentence ("from savings to
    checking" / "from checking to savings" moves "checking to" in front of "savings").
    """
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    changed = [op for op in ops if op[0] != "equal"]
    moved = {w for op in changed for w in a[op[1] : op[2]]} & {w for op in changed for w in b[op[3] : op[4]]}
    if not moved:
        return True
    runs_a = [(i1, i2) for _, i1, i2, _, _ in changed if moved & set(a[i1:i2])]
    runs_b = [(j1, j2) for _, _, _, j1, j2 in changed if moved & set(b[j1:j2])]
    if len(runs_a) != 1 or len(runs_b) != 1:
        return False
    (i1, i2), (j1, j2) = runs_a[0], runs_b[0]
    return (i1 == 0 or i2 == len(a)) and (j1 == 0 or j2 == len(b))


def texts_agree(a: str, b: str) -> bool:
    """True when ``a`` and ``b`` carry the same numbers (in order), the same negation words, and the same word
    order but for one phrase moved to or from an end (``_one_move``; checked on texts of at most
    ``ORDER_CHECK_WORDS`` words)."""
    if _NUMBER.findall(a) != _NUMBER.findall(b) or _negations(a) != _negations(b):
        return False
    wa, wb = _WORD.findall(a.lower()), _WORD.findall(b.lower())
    return len(wa) > ORDER_CHECK_WORDS or len(wb) > ORDER_CHECK_WORDS or _one_move(wa, wb)


def faiss_gpus() -> int:
    """GPUs this FAISS build can use (always 0 with ``faiss-cpu``)."""
    import faiss

    count = getattr(faiss, "get_num_gpus", None)
    return int(count()) if count is not None else 0


def index_device(pref: str) -> int | None:
    """The GPU the L3 index searches on for the device preference of the models (``FLEET_DEVICE``); None: the CPU.

    ``auto``: GPU 0 when FAISS can use a GPU, else the CPU (``faiss-cpu`` on a CUDA machine keeps the index on the
    CPU, the model still on the GPU). ``cuda`` / ``cuda:N``: that GPU. ``cpu``: the CPU.

    Raises:
        ConfigError: a GPU was asked for and FAISS can use none (``faiss-cpu`` installed, or no GPU), or ``N`` is
            not one of its GPUs.
    """
    pref = pref.strip().lower()
    if pref == "cpu":
        return None
    found = _CUDA.match(pref)
    if pref != "auto" and found is None:
        raise ConfigError(f"device {pref!r} is not supported; use auto, cpu, cuda or cuda:N")
    gpus = faiss_gpus()
    if pref == "auto":
        return 0 if gpus else None
    assert found is not None
    if not gpus:
        raise ConfigError(
            f"device {pref!r}: the L3 cache's FAISS sees no GPU (the faiss-cpu build, or no CUDA device); install "
            "faiss-gpu in place of faiss-cpu, or set FLEET_DEVICE=auto to keep the index on the CPU"
        )
    gpu = int(found.group(1) or 0)
    if gpu >= gpus:
        raise ConfigError(f"device {pref!r} does not exist for FAISS: {gpus} GPU(s) visible")
    return gpu


def gpu_mirror(gpu: int) -> Mirror:
    """Copies of an index on GPU ``gpu`` (FAISS's ``StandardGpuResources``, shared by the copies)."""
    import faiss

    resources = faiss.StandardGpuResources()  # type: ignore[attr-defined]  # in the faiss-gpu build only

    def mirror(index: faiss.Index) -> faiss.Index:
        return faiss.index_cpu_to_gpu(resources, gpu, index)  # type: ignore[attr-defined]

    return mirror


def default_nlist(max_entries: int) -> int:
    """About ``4 * sqrt(max_entries)`` inverted lists, a power of two between 16 and 4096."""
    target = 4 * math.sqrt(max_entries)
    return int(min(4096, max(16, 2 ** round(math.log2(max(target, 1))))))


class SemanticIndex:
    """Vectors with their cache keys and texts; ``search`` answers the nearest entry at or above a threshold.

    Not thread-safe: the gateway calls it from one thread at a time (its embedding worker thread).
    """

    def __init__(
        self, dim: int, *, max_entries: int, nprobe: int = 8, train_at: int | None = None, mirror: Mirror | None = None
    ) -> None:
        """``mirror`` (``gpu_mirror``): searches run on a copy it makes of the index, kept in step (module
        docstring); None: on the index itself."""
        self.dim = dim
        self._mirror = mirror
        self._searched: faiss.Index | None = None  # the mirror's copy; None: to be made at the next search
        self.max_entries = max_entries
        self.nlist = default_nlist(max_entries)
        self.nprobe = nprobe
        self.train_at = train_at if train_at is not None else min(max_entries, self.nlist * 16)
        import faiss

        self._index: faiss.Index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        self._entries: OrderedDict[int, tuple[str, str]] = OrderedDict()  # id -> (key, text), oldest first
        self._ids: dict[str, int] = {}
        self._forgotten: list[int] = []  # discarded ids whose vectors are still in FAISS
        self._next_id = 0
        self.trained = False

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._ids

    def add(self, vectors: np.ndarray, keys: list[str], texts: list[str]) -> int:
        """Add rows of ``vectors`` (unit norm, float32) for keys not held yet; returns how many were added."""
        fresh = [i for i, key in enumerate(keys) if key not in self._ids]
        fresh = [i for i in fresh if keys[i] not in {keys[j] for j in fresh if j < i}]
        if not fresh:
            return 0
        ids = np.arange(self._next_id, self._next_id + len(fresh), dtype=np.int64)
        self._next_id += len(fresh)
        for row_id, i in zip(ids.tolist(), fresh, strict=True):
            self._entries[row_id] = (keys[i], texts[i])
            self._ids[keys[i]] = row_id
        rows = np.ascontiguousarray(vectors[fresh], dtype=np.float32)
        self._index.add_with_ids(rows, ids)
        if self._searched is not None:
            self._searched.add_with_ids(rows, ids)
        if not self.trained and len(self._entries) >= self.train_at and self.train_at >= self.nlist:
            self._train()
        if len(self._entries) > self.max_entries:
            self._evict(len(self._entries) - int(self.max_entries * EVICT_TO))
        return len(fresh)

    def search(self, vectors: np.ndarray, texts: list[str], threshold: float) -> list[Match | None]:
        """Per query row: the most similar entry with similarity >= ``threshold`` whose text agrees, or None."""
        if not self._entries:
            return [None] * len(texts)
        scores, ids = self._searching().search(np.ascontiguousarray(vectors, dtype=np.float32), SEARCH_K)
        out: list[Match | None] = []
        for row_scores, row_ids, query in zip(scores.tolist(), ids.tolist(), texts, strict=True):
            out.append(self._best(row_scores, row_ids, query, threshold))
        return out

    def _searching(self) -> faiss.Index:
        if self._mirror is None:
            return self._index
        if self._searched is None:
            self._searched = self._mirror(self._index)
        return self._searched

    def _best(self, scores: list[float], ids: list[int], query: str, threshold: float) -> Match | None:
        for score, row_id in zip(scores, ids, strict=True):
            if row_id < 0 or score < threshold:
                return None  # sorted by score: nothing after this passes either
            entry = self._entries.get(row_id)
            if entry is not None and texts_agree(query, entry[1]):
                return Match(entry[0], entry[1], min(float(score), 1.0))
        return None

    def discard(self, key: str) -> None:
        """Forget ``key`` (its output is gone); its vector is dropped at the next batch eviction."""
        row_id = self._ids.pop(key, None)
        if row_id is not None:
            self._entries.pop(row_id, None)
            self._forgotten.append(row_id)

    def _evict(self, count: int) -> None:
        doomed: list[int] = []
        while self._entries and len(doomed) < count:
            row_id, (key, _) = self._entries.popitem(last=False)
            self._ids.pop(key, None)
            doomed.append(row_id)
        doomed.extend(self._forgotten)
        self._forgotten.clear()
        self._index.remove_ids(np.asarray(doomed, dtype=np.int64))  # type: ignore[arg-type]  # the SWIG wrapper takes ids
        self._searched = None  # a GPU index cannot remove ids: the next search copies the index again

    def _train(self) -> None:
        """Move the flat index's vectors into a trained IVF index."""
        import faiss

        flat: Any = self._index  # IndexIDMap2 over IndexFlatIP (the stubs know only Index)
        ids = faiss.vector_to_array(flat.id_map).astype(np.int64)
        vectors = flat.index.reconstruct_n(0, flat.ntotal)
        keep = np.asarray([int(i) in self._entries for i in ids], dtype=bool)
        ids, vectors = ids[keep], vectors[keep]
        self._forgotten.clear()
        quantizer = faiss.IndexFlatIP(self.dim)
        ivf = faiss.IndexIVFFlat(quantizer, self.dim, self.nlist, faiss.METRIC_INNER_PRODUCT)
        ivf.cp.min_points_per_centroid = 1  # training on what the cache holds; fewer points per list is fine
        ivf.train(vectors)
        ivf.add_with_ids(vectors, ids)
        ivf.nprobe = self.nprobe
        self._index = ivf
        self._searched = None
        self.trained = True
