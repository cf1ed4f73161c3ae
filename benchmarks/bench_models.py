"""Each task runtime served through Fleet against a bare transformers loop over the same model, texts and batch.

    python -m benchmarks.bench_models [--runtimes embeddings,classification,token-classification,rerank]
                                      [--infra memory|nats] [--items 1536] [--batch 32] [--repeats 5]

For each runtime a MiniLM-L6-sized BERT (hidden 384, 6 layers, 12 heads, vocab 30522: all-MiniLM-L6-v2's shape,
seeded random weights, its WordPiece tokenizer) with the runtime's head is written as a repository entry
(``model.yaml`` with every file's sha256) in a temporary folder, and:

* Fleet: the entry served by ``fleet.consumers.runtimes.runtime_handler(entry)`` in a ``Worker`` with
  ``max_batch`` ``--batch`` (for ``rerank`` ``--batch`` / ``--passages`` jobs: the same pairs a batch); every job
  (one text; for ``rerank`` one query and ``--passages`` passages) is published before the worker starts, and the
  clock runs from the worker's readiness to the last ack: its saturation throughput from a backlog, model plus
  fetch, store and ack;
* bare: a loop of ``tokenizer(batch, padding=True, truncation=True)``, the model's forward pass in
  ``torch.inference_mode`` and the task's minimum after it (mean pooling and normalisation, a softmax, a per-token
  argmax, a sigmoid) over the same texts, ``--batch`` texts (or query-passage pairs) a pass.

Items per second on each side (texts, or pairs for ``rerank``: ``--items`` of them a run, so ``--items`` /
``--passages`` rerank jobs), the two sides interleaved ``--repeats`` times; the ratio is the median of the rounds'
ratios (a loud round on a shared machine slows both of its sides), the throughputs shown the best of each side.
A run lasts a few seconds a side: with runs of about a second (512 texts), a two-core machine's noise moved the
ratio more than Fleet's own cost does. Target: Fleet / bare >= 0.9 on a CPU. Writes
``benchmarks/results/models.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks.cache_workload import bases
from benchmarks.common import Timer, best_of, paired_median, services, show, write_result
from fleet import constants as c
from fleet.repository.entry import RepositoryEntry
from fleet.repository.synth import TOKENIZER_FILES, tokenizer_source
from fleet.repository.verify import sha256_of
from fleet.schemas.manifest import MANIFEST_FILE, ModelManifest
from fleet.settings import FleetSettings

RUNTIMES = ("embeddings", "classification", "token-classification", "rerank")
RUNTIME_HANDLER = "fleet.consumers.runtimes:runtime_handler"  # (entry) -> the ModelHandler class serving it
MINILM_SHAPE = {
    "hidden_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
    "vocab_size": 30522,
}
CLASS_LABELS = ("negative", "neutral", "positive", "question")
TOKEN_LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")


@dataclass(frozen=True, slots=True)
class Task:
    """How one runtime's model is built, what one job asks, and the bare loop's work after the forward pass."""

    runtime: str
    head: str  # the transformers class
    labels: tuple[str, ...]

    def job(self, texts: list[str], i: int, passages: int) -> dict[str, Any]:
        if self.runtime == "rerank":
            return {"query": texts[i], "texts": [texts[(i + k + 1) % len(texts)] for k in range(passages)]}
        return {"text": texts[i]}


TASKS = {
    t.runtime: t
    for t in (
        Task("embeddings", "AutoModel", ()),
        Task("classification", "AutoModelForSequenceClassification", CLASS_LABELS),
        Task("token-classification", "AutoModelForTokenClassification", TOKEN_LABELS),
        Task("rerank", "AutoModelForSequenceClassification", ("score",)),
    )
}


def texts_of(count: int) -> list[str]:
    """Request-like texts (8 to 12 words) from the cache benchmark's generator, varied so batches are not uniform."""
    return [b.text for b in bases()[:count]]


def build_entry(task: Task, root: Path, batch: int, seed: int = 0) -> RepositoryEntry:
    """Write ``task``'s MiniLM-sized model as ``<root>/bench-<runtime>-<token>/1`` and return its entry."""
    import torch
    import transformers
    from transformers import BertConfig

    labels = dict(enumerate(task.labels))
    config = BertConfig(**MINILM_SHAPE, id2label=labels or None, label2id={v: k for k, v in labels.items()} or None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, task.head).from_config(config).eval()
    name = f"bench-{task.runtime}-{uuid.uuid4().hex[:6]}"
    folder = root / name / "1"
    folder.mkdir(parents=True)
    model.save_pretrained(folder, safe_serialization=True)
    for file in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_source() / file, folder / file)
    files = {p.name: sha256_of(p) for p in sorted(folder.iterdir()) if p.is_file()}
    manifest = ModelManifest.model_validate(
        {
            "runtime": task.runtime,
            "task": task.runtime,
            "description": f"bench_models: a MiniLM-L6-sized {task.runtime} model with random weights",
            "weights": {"files": files},
            "batching": {"max_batch": batch, "max_wait_ms": 5},
        }
    )
    (folder / MANIFEST_FILE).write_text(yaml.safe_dump(manifest.model_dump(mode="json", exclude_none=True)))
    return RepositoryEntry(name, "1", folder, folder, manifest)


# -- bare -----------------------------------------------------------------------------------------------------
def after_forward(runtime: str) -> Callable[[Any, Any], Any]:
    """The least a bare loop does with a forward pass's output for the task."""
    import torch

    def pooled(out: Any, mask: Any) -> Any:
        weights = mask.unsqueeze(-1).float()
        mean = (out.last_hidden_state.float() * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(mean, dim=1).tolist()

    return {
        "embeddings": pooled,
        "classification": lambda out, _: out.logits.float().softmax(-1).tolist(),
        "token-classification": lambda out, _: out.logits.float().softmax(-1).max(-1),
        "rerank": lambda out, _: out.logits.float().sigmoid().squeeze(-1).tolist(),
    }[runtime]


def bare_throughput(entry: RepositoryEntry, task: Task, jobs: list[dict[str, Any]], batch: int, device: str) -> float:
    """Items per second of a plain transformers loop over the jobs' texts (or query-passage pairs)."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    folder = str(entry.weights_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = getattr(transformers, task.head).from_pretrained(folder, local_files_only=True).to(device).eval()
    finish = after_forward(task.runtime)
    if task.runtime == "rerank":
        items: list[Any] = [(job["query"], passage) for job in jobs for passage in job["texts"]]
    else:
        items = [job["text"] for job in jobs]

    def encode(chunk: list[Any]) -> Any:
        if task.runtime == "rerank":
            queries, passages = [q for q, _ in chunk], [p for _, p in chunk]
            return tokenizer(queries, passages, padding=True, truncation=True, return_tensors="pt")
        return tokenizer(chunk, padding=True, truncation=True, return_tensors="pt")

    def run(chunk: list[Any]) -> None:
        enc = encode(chunk).to(device)
        out = model(**enc)
        finish(out, enc["attention_mask"])

    with torch.inference_mode():
        run(items[:batch])  # warm-up, as the worker's
        started = time.perf_counter()
        for start in range(0, len(items), batch):
            run(items[start : start + batch])
        return len(items) / (time.perf_counter() - started)


# -- fleet ----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def infra_settings(kind: str, **values: Any) -> Iterator[FleetSettings]:
    if kind == "memory":
        yield FleetSettings(**values)
        return
    with services() as urls:
        yield FleetSettings(broker_url=urls["nats"], store_url=urls["redis"], **values)


async def fleet_throughput(
    settings: FleetSettings, entry: RepositoryEntry, jobs: list[dict[str, Any]], batch: int, device: str, items: int
) -> float:
    """Items per second of the entry served by its runtime in a worker, from a backlog of ``jobs``."""
    from fleet.brokers import make_broker
    from fleet.consumers.worker import Worker
    from fleet.models import import_object
    from fleet.producers.publish import publish_all
    from fleet.schemas.wire import RequestMessage
    from fleet.store import make_store

    runtime_handler = import_object(RUNTIME_HANDLER)  # the runtimes' package (issue 28)
    handler = runtime_handler(entry)(device=device)
    model = handler.spec.name
    broker, store = make_broker(settings), make_store(settings)
    await broker.connect()
    await store.connect()
    try:
        await broker.ensure_model(model)
        messages = [RequestMessage(job_id=uuid.uuid4().hex, model=model, input=job) for job in jobs]
        await publish_all(broker, messages)
        async with Worker(handler, broker, store, settings=settings, device=device, max_batch=batch):
            with Timer() as t:
                while await broker.lag(c.request_subject(model), c.consumer_name(model)) > 0:  # noqa: ASYNC110 - polled
                    await asyncio.sleep(0.01)
            last = await store.get(messages[-1].job_id)
            assert last is not None and last.state == "succeeded", last
    finally:
        await store.close()
        await broker.close()
    return items / t.seconds


async def measure(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with infra_settings(args.infra, max_wait_ms=5.0, device=args.device) as settings:
        for runtime in args.runtimes:
            task = TASKS[runtime]
            per_job = args.passages if runtime == "rerank" else 1
            texts = texts_of(max(1, args.items // per_job))
            jobs = [task.job(texts, i, args.passages) for i in range(len(texts))]
            items, job_batch = len(jobs) * per_job, max(1, args.batch // per_job)  # batch items a pass, both sides
            entry = build_entry(task, root, job_batch)
            fleet_runs, bare_runs = [], []
            for _ in range(args.repeats):  # interleaved: the machine's noise hits both sides alike
                fleet_runs.append(await fleet_throughput(settings, entry, jobs, job_batch, args.device, items))
                bare_runs.append(bare_throughput(entry, task, jobs, args.batch, args.device))
            fleet, bare = best_of(fleet_runs), best_of(bare_runs)
            ratio = paired_median(fleet_runs, bare_runs)
            out[runtime] = {
                "fleet_items_per_s": fleet,
                "bare_items_per_s": bare,
                "ratio": ratio,
                "target": 0.9,
                "fleet_runs": fleet_runs,
                "bare_runs": bare_runs,
                "items": items,
            }
            print(f"{runtime}: fleet {fleet_runs}/s, bare {bare_runs}/s, paired ratio {ratio:.2f}", flush=True)
    return out


def main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="fleet-bench-models-"))
    try:
        results = asyncio.run(measure(args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    show(
        f"runtimes through Fleet ({args.infra}, {args.device}) against bare transformers, batch {args.batch}",
        [
            (f"{runtime}: fleet / bare items/s", f"{r['ratio']:.2f} ({r['fleet_items_per_s']:.0f} vs "
             f"{r['bare_items_per_s']:.0f})", ">= 0.9")
            for runtime, r in results.items()
        ],
    )  # fmt: skip
    print(f"wrote {write_result('models', {'runtimes': results, 'params': vars(args)})}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtimes", default=",".join(RUNTIMES), help="comma-separated, of " + ", ".join(RUNTIMES))
    parser.add_argument("--infra", choices=["memory", "nats"], default="memory", help="nats: NATS + Redis")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--items", type=int, default=1536, help="items per run: texts (query-passage pairs for rerank)")
    parser.add_argument("--passages", type=int, default=4, help="passages per rerank job")
    parser.add_argument("--batch", type=int, default=32, help="the worker's max_batch and the bare loop's batch")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds of both sides")
    args = parser.parse_args(argv)
    args.runtimes = [r.strip() for r in args.runtimes.split(",") if r.strip()]
    unknown = [r for r in args.runtimes if r not in TASKS]
    if unknown:
        parser.error(f"unknown runtime(s) {', '.join(unknown)}; known: {', '.join(RUNTIMES)}")
    return args


if __name__ == "__main__":
    main(parse_args())
