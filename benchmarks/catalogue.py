"""Every benchmark, listed once: the result file it writes, how ``make bench`` runs it, what it measures and what it
needs. ``benchmarks.run_all`` runs this list; ``benchmarks.report`` renders one section per entry, measured or not.

Standard library only: the docs build imports it.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

GPU = "gpu"
VALGRIND = "valgrind"
EXTRACT = "extract"  # the cost stand-in in ./models (fleet models synth), about 440 MB: built, not committed
EXTRACT_MANIFEST = "models/extract/1/model.yaml"  # under the checkout, where make bench runs


@dataclass(frozen=True, slots=True)
class Benchmark:
    name: str  # the result file: benchmarks/results/<name>.json
    module: str  # run as python -m <module>
    args: tuple[str, ...]  # the arguments make bench gives it
    measures: str  # one sentence for the benchmarks page
    needs: str | None = None  # GPU, VALGRIND or EXTRACT: skipped, with the reason, where missing

    @property
    def command(self) -> str:
        return " ".join(["python -m", self.module, *self.args])


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "startup",
        "benchmarks.bench_startup",
        (),
        "Whole `fleet` processes from their start to the moment they are of use: `fleet --help` to its exit, "
        "`fleet worker --model echo` to its `/readyz` 200, and `fleet up` with `embed` to its `/readyz` 200; the "
        "median of several runs each.",
    ),
    Benchmark(
        "pipeline",
        "benchmarks.bench_pipeline",
        (),
        "Echo throughput through the fleet against the broker's raw client doing the same delivery work, on NATS "
        "and on Kafka, and end-to-end p50/p99 latency at about 70 % of the fleet's saturation throughput.",
    ),
    Benchmark(
        "embed",
        "benchmarks.bench_embed",
        ("--infra", "nats"),
        "`embed` through the fleet with micro-batching against a maximum batch of 1, and fleet `embed` throughput "
        "against a bare transformers loop at the same batch size.",
    ),
    Benchmark(
        "embed-fleet",
        "benchmarks.bench_embed_fleet",
        (),
        "`embed` served by N `fleet worker` processes sharing one device over NATS + Redis, against the bare loop.",
    ),
    Benchmark(
        "model",
        "benchmarks.bench_model",
        (),
        "The bare-model baseline: plain transformers embedding texts with no fleet around it, and the `embed` "
        "handler on the same texts.",
    ),
    Benchmark(
        "bench_dispatch",
        "benchmarks.bench_dispatch",
        (),
        "Load balancing on a fleet of `sleep` workers (some slow), every dispatch policy side by side under "
        "open-loop load: p99 and p99/p50 against load.",
    ),
    Benchmark(
        "autoscaler",
        "benchmarks.bench_autoscaler",
        (),
        "The autoscaler driving real `fleet worker` processes under a step load and a sawtooth load of `sleep` "
        "jobs: time to scale out, jobs waiting, and replicas against the load.",
    ),
    Benchmark(
        "bench_cache",
        "benchmarks.bench_cache",
        (),
        "The result caches (exact, shared and semantic) on a generated `embed` workload over NATS + Redis: hit "
        "rates and latency against the same requests bypassing the cache.",
    ),
    Benchmark(
        "bench_cache_extract",
        "benchmarks.bench_cache",
        tuple("--model extract --mix seeds --repository models".split()),
        "The result caches on `extract`, the seeds' costly model (a DeBERTa-v2-base-sized cost stand-in built by "
        "`fleet models synth`), whose L3 is keyed by `embed`: throughput with caches against without at the seeds' "
        "hit mix, and the L3 wrong-hit share on labelled pairs.",
        EXTRACT,
    ),
    Benchmark(
        "stand_in_cost",
        "benchmarks.stand_in_cost",
        tuple("--extract models/extract/1".split()),
        "What `extract` (DeBERTa-v2-base-sized) costs per text against `embed` (MiniLM-L6), its L3 embedder, on the "
        "same token ids: batch 16, 44 tokens.",
        EXTRACT,
    ),
    Benchmark(
        "multimodel",
        "benchmarks.bench_multimodel",
        ("--parts", "replicas"),
        "Memory (PSS and RSS) and jobs/s of N replicas of `embed` in one process against N `fleet worker` processes "
        "(N = 4 and 8, end to end over NATS + Redis, the same threads per batch on both sides).",
    ),
    Benchmark(
        "multimodel-pool",
        "benchmarks.bench_multimodel",
        ("--parts", "pool"),
        "8 MiniLM-sized models on 2 multi-model workers whose memory budget holds 4, in pull routing and in dispatch "
        "routing with affinity (one `fleet dispatcher`), against 8 dedicated workers, under Zipf traffic over NATS + "
        "Redis: cold loads per 1,000 jobs, p50 and p99, memory.",
    ),
    Benchmark(
        "models",
        "benchmarks.bench_models",
        (),
        "Each task runtime (embeddings, classification, token-classification, rerank) serving a MiniLM-sized model "
        "through Fleet against a bare transformers loop over the same model, texts and batch.",
    ),
    Benchmark(
        "dag",
        "benchmarks.bench_dag",
        (),
        "DAG runs against the same jobs driven step by step by a client, over NATS JetStream + Redis.",
    ),
    Benchmark(
        "bench_adaptive",
        "benchmarks.bench_adaptive",
        (),
        "Micro-batches sized from a p99 target against fixed batch settings, under stepped load.",
    ),
    Benchmark(
        "priority",
        "benchmarks.bench_priority",
        (),
        "Priorities under overload: latency of high, normal and low jobs on one worker offered more than it can do.",
    ),
    Benchmark(
        "tracing",
        "benchmarks.bench_tracing",
        (),
        "Job throughput of an echo worker over NATS + Redis with tracing exporting to a real Jaeger, with it off, "
        "and on the commit before tracing (a temporary git worktree), interleaved in fresh processes.",
    ),
    Benchmark(
        "peers",
        "benchmarks.bench_peers",
        (),
        "Fleet's `echo` worker against a minimal FastStream NATS subscriber, side by side on the same servers.",
    ),
    Benchmark(
        "bench_auth",
        "benchmarks.bench_auth",
        (),
        "What API keys and per-tenant rate limits cost the gateway: submit throughput with them on and off.",
    ),
    Benchmark(
        "bench_batch",
        "benchmarks.bench_batch",
        (),
        "What `POST /v1/jobs:batch` saves: 500 echo jobs as one batch against 500 single `POST /v1/jobs`.",
    ),
    Benchmark(
        "bench_dashboard",
        "benchmarks.bench_dashboard",
        (),
        "What open operator streams cost the gateway: job throughput with 0 and with 50 dashboard readers.",
    ),
    Benchmark(
        "cluster",
        "benchmarks.bench_cluster",
        (),
        "Writes of finished records on a 3-primary Redis Cluster against one Redis.",
    ),
    Benchmark(
        "compact",
        "benchmarks.bench_compact",
        (),
        "Compact results: a zero-cost `embed` worker over NATS + Redis, float against base64 outputs.",
    ),
    Benchmark(
        "instructions",
        "benchmarks.bench_instructions",
        (),
        "Instructions per job of a zero-cost `embed` worker and Redis's instructions per result, counted by "
        "callgrind, so the figure does not move with the machine's load.",
        VALGRIND,
    ),
    Benchmark(
        "gateway_attacks-current",
        "benchmarks.gateway_attacks",
        (),
        "Small hostile requests (deep JSON, huge numbers, costly DAG expressions) sent to a real gateway and worker, "
        "with the gateway's `/healthz` latency while each is in flight.",
    ),
    Benchmark(
        "chaos",
        "benchmarks.chaos",
        (),
        "Fault runs: jobs lost, settled twice, computed twice or failed while parts of Fleet are killed.",
    ),
    Benchmark(
        "gpu_parity",
        "benchmarks.gpu_parity",
        ("--device", "cuda"),
        "`embed`'s vectors on the GPU (fp16) against those on the CPU (fp32): the lowest cosine similarity.",
        GPU,
    ),
    Benchmark(
        "embed-gpu",
        "benchmarks.bench_embed",
        tuple(
            "--device cuda --infra memory --random-weights auto --jobs 20000 --single-jobs 3000 --batch 256 "
            "--words 16 --name embed-gpu".split()
        ),
        "`embed` on a GPU: micro-batching against batch 1, and the fleet against bare transformers.",
        GPU,
    ),
    Benchmark(
        "embed-gpu-fleet",
        "benchmarks.bench_embed_fleet",
        tuple(
            "--device cuda --random-weights auto --workers 1,2,4,8 --jobs 100000 --batch 256 --words 16 "
            "--name embed-gpu-fleet".split()
        ),
        "1, 2, 4 and 8 `fleet worker` processes sharing one GPU over NATS + Redis, against the bare loop.",
        GPU,
    ),
)


def by_name() -> dict[str, Benchmark]:
    return {b.name: b for b in BENCHMARKS}


def missing(needs: str | None) -> str | None:
    """Why a benchmark needing ``needs`` cannot run on this machine, or None when it can."""
    if needs == VALGRIND and (shutil.which("valgrind") is None or shutil.which("callgrind_control") is None):
        return "needs valgrind and callgrind_control (Debian: apt-get install valgrind)"
    if needs == EXTRACT and not (Path(__file__).resolve().parent.parent / EXTRACT_MANIFEST).is_file():
        return (
            f"needs the extract cost stand-in ({EXTRACT_MANIFEST}): "
            "fleet models synth deberta-v2-base --task token-classification --name extract"
        )
    if needs == GPU and not has_gpu():
        return "needs a CUDA GPU (nvidia-smi lists none); scripts/bench_gpu.sh runs these where one is"
    return None


def has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and "GPU" in out.stdout
