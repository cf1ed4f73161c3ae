"""The bare-model baseline: how fast plain transformers embeds texts with no fleet around it.

``bare_transformers_throughput`` does the same work as the ``embed`` handler (tokenize with padding and truncation
to 256 tokens, forward, mean-pool over the attention mask, L2-normalise, copy to the host) in the plainest loop, so
a fleet benchmark can report its throughput as a ratio of this one. ``handler_throughput`` times the handler itself
on the same texts.

Run ``python -m benchmarks.bench_model --device auto`` from the repository root for a table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.common import show, write_result
from fleet.consumers.device import resolve_device
from fleet.consumers.handlers.embed import (
    EmbedHandler,
    _has_weights,
    load_encoder_model,
    load_token_encoder,
    max_seq_tokens,
    packaged_model_path,
)
from fleet.schemas.models import EmbedInput


def use_random_weights(choice: str) -> bool:
    """The benchmarks' ``--random-weights auto|yes|no``: ``auto`` uses random weights only when the packaged
    weights are missing."""
    return choice == "yes" or (choice == "auto" and not _has_weights(packaged_model_path()))


def sample_texts(count: int, words: int = 24) -> list[str]:
    """Distinct English-like sentences of about ``words`` words."""
    vocab = "fleet worker batch token redis stream model queue latency vector shard replica gateway".split()
    return [" ".join(vocab[(i * 7 + j * 3) % len(vocab)] for j in range(words)) + f" #{i}" for i in range(count)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bare_transformers_throughput(
    texts: list[str], batch_size: int, device: str = "auto", random_weights: bool = False
) -> float:
    """Items per second of a plain transformers loop over ``texts`` in batches of ``batch_size``.

    The model is loaded (fp16 on CUDA) and one batch is run untimed before the clock starts.
    """
    device = resolve_device(device)
    path: Path | None = packaged_model_path()
    model = load_encoder_model(path, random_weights=random_weights, device=device)
    tokens = load_token_encoder(path, int(model.config.vocab_size), allow_synthetic=random_weights)
    max_len = max_seq_tokens(path)

    def run(batch: list[str]) -> torch.Tensor:
        ids = tokens.encode(batch, max_len)
        longest = max(len(r) for r in ids)
        input_ids = torch.tensor([r + [tokens.pad_id] * (longest - len(r)) for r in ids], device=device)
        mask = torch.tensor([[1] * len(r) + [0] * (longest - len(r)) for r in ids], device=device)
        hidden = model(input_ids=input_ids, attention_mask=mask).last_hidden_state.float()
        weights = mask.unsqueeze(-1).float()
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=1).cpu()

    with torch.inference_mode():
        run(texts[:batch_size])
        _sync(device)
        started = time.perf_counter()
        for i in range(0, len(texts), batch_size):
            run(texts[i : i + batch_size])
        _sync(device)
    return len(texts) / (time.perf_counter() - started)


def handler_throughput(texts: list[str], batch_size: int, device: str = "auto", random_weights: bool = False) -> float:
    """Items per second of ``EmbedHandler.run`` on jobs of one text each, ``batch_size`` jobs per call."""
    handler = EmbedHandler(device=resolve_device(device), random_weights=random_weights)
    handler.load()
    handler.warmup()
    jobs = [EmbedInput.model_validate({"text": t}) for t in texts]
    handler.run(jobs[:batch_size])
    started = time.perf_counter()
    for i in range(0, len(jobs), batch_size):
        handler.run(jobs[i : i + batch_size])
    return len(jobs) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--batch-size", type=int, action="append", help="repeatable; default 1 and 64")
    parser.add_argument("--random-weights", action="store_true")
    args = parser.parse_args()
    texts = sample_texts(args.texts)
    rows, figures = [], {}
    for batch_size in args.batch_size or [1, 64]:
        bare = bare_transformers_throughput(texts, batch_size, args.device, args.random_weights)
        handler = handler_throughput(texts, batch_size, args.device, args.random_weights)
        figures[f"batch_{batch_size}"] = {"bare_items_per_s": bare, "handler_items_per_s": handler}
        rows.append((f"batch {batch_size}: bare items/s", f"{bare:,.1f}", ""))
        rows.append((f"batch {batch_size}: handler / bare", f"{handler / bare:.2f}", ""))
    show(f"The embed model on {args.device}, {len(texts)} texts", rows)
    print(f"wrote {write_result('model', {'args': vars(args), **figures})}")


if __name__ == "__main__":
    main()
