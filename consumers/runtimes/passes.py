"""Forward passes by token budget: the batching machinery every text runtime (and ``embed``) shares.

A micro-batch is flattened (every text of every job), tokenized once, sorted by token count so that texts of
similar length share a forward pass (less padding), cut into forward passes of at most ``max_tokens_per_forward``
padded tokens, and split back per job. The functions here are that recipe's steps; a runtime loops over
``sorted_passes`` and runs its model on ``pad_batch`` of each pass.

``torch`` is imported inside the functions that build tensors, so importing this module costs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

# English word pieces run about 4 to 5 characters each; 4 over-estimates a little, so a budget is rarely passed
CHARS_PER_TOKEN = 4
CPU_TOKENS_PER_FORWARD = 8192
CUDA_TOKENS_PER_FORWARD = 65536


def estimate_tokens(chars: int, cap: int, specials: int = 2) -> int:
    """Tokens a text of ``chars`` characters is likely to take, without running a tokenizer: its special tokens
    plus one per ``CHARS_PER_TOKEN`` characters, at most the truncation length ``cap``."""
    return min(cap, specials + math.ceil(chars / CHARS_PER_TOKEN))


def default_tokens_per_forward(cuda: bool) -> int:
    return CUDA_TOKENS_PER_FORWARD if cuda else CPU_TOKENS_PER_FORWARD


def forward_chunks(lengths: list[int], max_tokens_per_forward: int) -> Iterator[slice]:
    """Cut rows sorted by length (longest first) into slices whose padded size fits the token budget."""
    start = 0
    while start < len(lengths):
        rows = max(1, max_tokens_per_forward // max(lengths[start], 1))
        yield slice(start, min(start + rows, len(lengths)))
        start += rows


def sorted_passes(ids: Sequence[Sequence[int]], max_tokens_per_forward: int) -> Iterator[list[int]]:
    """The row indices of each forward pass: rows sorted longest first, cut by padded-token budget."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]), reverse=True)
    for chunk in forward_chunks([len(ids[i]) for i in order], max_tokens_per_forward):
        yield order[chunk]


def pad_batch(ids: list[list[int]], pad_id: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token ids to the longest row: ``(input_ids, attention_mask)``, both ``[rows, longest]``."""
    import torch

    longest = max(len(row) for row in ids)
    input_ids = torch.tensor([row + [pad_id] * (longest - len(row)) for row in ids], dtype=torch.long)
    mask = torch.tensor([[1] * len(row) + [0] * (longest - len(row)) for row in ids], dtype=torch.long)
    return input_ids.to(device), mask.to(device)


def pad_rows(rows: list[list[int]], value: int, device: str) -> torch.Tensor:
    """Right-pad other per-token rows (token type ids) the way ``pad_batch`` pads the ids."""
    import torch

    longest = max(len(row) for row in rows)
    return torch.tensor([row + [value] * (longest - len(row)) for row in rows], dtype=torch.long).to(device)


def flatten(jobs: Sequence[Sequence[T]]) -> tuple[list[T], list[int]]:
    """Every item of every job in one list, and how many each job gave (for ``split_back``)."""
    return [item for job in jobs for item in job], [len(job) for job in jobs]


def job_slices(counts: Sequence[int]) -> list[slice]:
    """The slice of the flat list that belongs to each job."""
    out, start = [], 0
    for n in counts:
        out.append(slice(start, start + n))
        start += n
    return out


def split_back(values: Sequence[T], counts: Sequence[int]) -> list[list[T]]:
    """The flat results cut back into one list per job, in the jobs' order."""
    return [list(values[s]) for s in job_slices(counts)]
