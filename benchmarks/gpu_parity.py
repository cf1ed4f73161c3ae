"""Do `embed`'s vectors on the GPU (fp16) agree with those on the CPU (fp32)?

Embeds the same texts (short, long and past the 256-token truncation, so padding, sorting and forward chunking are
all exercised) with ``EmbedHandler`` on the CPU and on ``--device``, and prints the lowest cosine similarity, the
largest absolute difference and the norms. Exits 1 when the lowest cosine is under ``--min-cosine``.

With ``--random-weights`` (or ``auto`` on a machine without the packaged weights) both sides build the same
seeded random weights, so the check still compares the two numeric paths.

    python -m benchmarks.gpu_parity --device cuda
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.bench_model import sample_texts, use_random_weights
from benchmarks.common import show, write_result
from fleet.consumers.handlers.embed import EmbedHandler


def parity_texts() -> list[str]:
    """Texts from one word to far past 256 tokens, in no particular order."""
    lengths = [1, 3, 8, 16, 40, 120, 300, 600]
    return [text for i, words in enumerate(lengths) for text in sample_texts(24, words + i)]


def embeddings(device: str, texts: list[str], random_weights: bool) -> torch.Tensor:
    handler = EmbedHandler(device=device, random_weights=random_weights, max_tokens_per_forward=4096)
    handler.load()
    try:
        return torch.tensor(handler.embed_texts(texts), dtype=torch.float64)
    finally:
        handler.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="the device compared with the CPU")
    parser.add_argument("--random-weights", choices=["auto", "yes", "no"], default="auto")
    parser.add_argument("--min-cosine", type=float, default=0.999)
    args = parser.parse_args()
    random_weights = use_random_weights(args.random_weights)
    texts = parity_texts()
    reference = embeddings("cpu", texts, random_weights)
    tested = embeddings(args.device, texts, random_weights)
    cosine = (reference * tested).sum(dim=1) / (reference.norm(dim=1) * tested.norm(dim=1))
    worst = int(cosine.argmin())
    weights = "random" if random_weights else "packaged"
    print(f"embed parity, {args.device} vs cpu, {len(texts)} texts, {weights} weights")
    print(f"  lowest cosine similarity   {float(cosine.min()):.6f} (text of {len(texts[worst].split())} words)")
    print(f"  mean cosine similarity     {float(cosine.mean()):.6f}")
    print(f"  largest absolute difference {float((reference - tested).abs().max()):.2e}")
    norms = tested.norm(dim=1)
    print(f"  norms on {args.device}: {float(norms.min()):.6f} .. {float(norms.max()):.6f}")
    lowest = float(cosine.min())
    mean = float(cosine.mean())
    rows = [("lowest cosine similarity", f"{lowest:.6f}", f">= {args.min_cosine}"), ("mean", f"{mean:.6f}", "")]
    show(f"embed parity, {args.device} against cpu", rows)
    figures = {"texts": len(texts), "weights": weights, "lowest_cosine": lowest, "mean_cosine": mean}
    figures["max_abs_difference"] = float((reference - tested).abs().max())
    print(f"wrote {write_result('gpu_parity', figures)}")
    if float(cosine.min()) < args.min_cosine:
        print(f"FAIL: lowest cosine {float(cosine.min()):.6f} < {args.min_cosine}")
        return 1
    print(f"ok: every vector within cosine {args.min_cosine} of the CPU's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
