"""The result caches on a generated workload, over NATS JetStream + Redis, one run: on ``embed``, or on
``extract``, the seeds' costly model, at the seeds' hit mix.

    python -m benchmarks.bench_cache [--requests 20000] [--concurrency 32] [--rounds 10]
    python -m benchmarks.bench_cache --model extract --mix seeds [--repository models]

A ``fleet gateway`` (``FLEET_CACHE=<model>``: L1 + L2 + L3) and a ``fleet worker --model <model>`` process, as a
user runs them. The workload (``benchmarks.cache_workload``): ``--requests`` requests of one ``text`` each, drawn
Zipf-like from 2,000 base texts (the first ``--pool`` of them) and light paraphrases of them (case, punctuation,
word order, a synonym). The gateway's L1 holds ``--l1-entries`` entries (default 300,
FLEET_CACHE_L1_MAX_ENTRIES), small on purpose so that the tail of the distribution falls through to L2, as it does
behind several gateways.

``--model extract`` serves the cost stand-in of the seeds' RexUniNLU service (``fleet models synth
deberta-v2-base --task token-classification --name extract``), whose L3 is keyed by ``embed``'s vectors
(``cache_embedder``): a lookup costs a tenth of a computation, not a whole one. It is served by the
token-classification runtime from the repository (``--repository``, default ``models``).
``--mix seeds`` sets the workload that lands near the seeds' mix (L1 35 %, L2 28 %, L3 12 %, miss 25 %:
``cache_workload.SEEDS_WORKLOAD``); the run prints the mix it planned and the one it got.

What is measured:

* hit rates per level, and L3 hits that answered with another base text's output (wrong answers);
* throughput with caches against without: the workload is cut into ``--rounds`` chunks; each chunk runs with the
  caches, then a share (``--baseline-share``) of the same chunk runs with ``X-Cache-Control: bypass`` (computed by
  the worker; no lookup, no fill), interleaved, so both sides see the same noise. Each request is one
  ``POST /v1/infer`` (the output in one request), sent by the SDK's aiohttp client from ``--concurrency`` tasks.
  Target: >= 3x;
* the gateway p50 of an L1 hit: sequential ``POST /v1/jobs`` of hot texts, one at a time, client-measured over
  loopback HTTP (target < 2 ms);
* the L3 lookup cost per query with 100,000 entries: the FAISS index (``SemanticIndex``) filled with the labelled
  texts' real vectors plus random unit vectors, one query per call as the gateway searches (target < 1 ms);
  embedding the query text (batched in the gateway) is reported apart;
* the share of L3 hits whose text has another meaning on the labelled pairs (target < 1 %), at embed's threshold
  with the guard, searched in that 100,000-entry index; with a threshold sweep.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.cache_workload import SEEDS_MIX, SEEDS_WORKLOAD, expected_levels, labelled_pairs, requests
from benchmarks.common import RESULTS_DIR, percentiles_ms, services, show, stop_processes, write_result
from fleet.producers.gateway.cache.embedder import load_embed_handler
from fleet.producers.gateway.cache.semantic_index import SemanticIndex, texts_agree
from fleet.producers.sdk_http import AiohttpHttp, GatewayUnreachable, Http
from fleet.schemas.models import EMBED, EMBED_DIM
from tests.processes import ROOT, fleet_argv, fleet_env
from tests.services import die_with_parent, free_port

BYPASS = {"X-Cache-Control": "bypass"}
# the embed / extract cost per text (benchmarks.stand_in_cost), for the ceiling rows
STAND_IN_COST = RESULTS_DIR / "stand_in_cost.json"  # benchmarks.stand_in_cost: extract / embed per text


class CacheFleet:
    """A ``fleet gateway`` with the caches on and a ``fleet worker`` serving the model."""

    def __init__(
        self,
        urls: dict[str, str],
        l1_entries: int,
        log_dir: Path,
        levels: str = "l1+l2+l3",
        model: str = "embed",
        ref: str = "embed",
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.l3 = "l3" in levels
        self.model, self.ref = model, ref
        self.url = f"http://127.0.0.1:{self.port}"
        env = {"FLEET_BROKER_URL": urls["nats"], "FLEET_STORE_URL": urls["redis"], "FLEET_MODELS": ref}
        env |= {"FLEET_CACHE": f"{model}={levels}", "FLEET_CACHE_L1_MAX_ENTRIES": str(l1_entries)}
        env["FLEET_DEVICE"] = "cpu"
        self.env, self.log_dir = fleet_env(**env, **(extra_env or {})), log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> CacheFleet:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for name, argv in (
            ("gateway", ["gateway", "--port", str(self.port)]),
            ("worker", ["worker", "--model", self.ref]),
        ):
            with (self.log_dir / f"{name}.log").open("wb") as out:
                self.procs.append(
                    subprocess.Popen(
                        fleet_argv(*argv),
                        env=self.env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        cwd=ROOT,
                        preexec_fn=die_with_parent,
                    )
                )
        return self

    def __exit__(self, *exc: object) -> None:
        stop_processes(self.procs, timeout_s=20)

    async def ready(self, http: Http, timeout_s: float = 300) -> None:
        """Until /readyz answers, the L3 model is loaded, and an embed job ran end to end."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a fleet process exited; see the logs in {self.log_dir}")
            try:
                status, metrics = await http.request("GET", "/metrics", timeout_s=2)
                if status == 200 and (b"fleet_cache_l3_ready 1.0" in metrics or not self.l3):
                    await infer(http, self.model, "warm-up text", BYPASS)
                    return
            except GatewayUnreachable:
                pass
            await asyncio.sleep(0.5)
        raise RuntimeError(f"the fleet was not ready within {timeout_s:g}s; see {self.log_dir}")


async def infer(http: Http, model: str, text: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """One ``POST /v1/infer`` (the output in one request, as a client that wants answers calls it); the answer,
    with its latency. Retried on a dropped connection (idempotent: it carries its job id)."""
    body = {"model": model, "input": {"text": text}, "job_id": uuid.uuid4().hex}
    for attempt in range(3):
        started = time.perf_counter()
        try:
            status, raw = await http.request("POST", "/v1/infer", json=body, headers=headers, timeout_s=120)
        except GatewayUnreachable:
            if attempt == 2:
                raise
            continue
        answer: dict[str, Any] = json.loads(raw)
        assert status == 200, answer
        answer["latency_s"] = time.perf_counter() - started
        return answer
    raise AssertionError("unreachable")


async def submit_latency(http: Http, model: str, text: str) -> tuple[float, dict[str, Any]]:
    """One ``POST /v1/jobs``: its latency and answer (an L1 hit answers ``succeeded`` at once)."""
    body = {"model": model, "input": {"text": text}}
    started = time.perf_counter()
    status, raw = await http.request("POST", "/v1/jobs", json=body, timeout_s=30)
    elapsed = time.perf_counter() - started
    assert status == 202, raw
    answer: dict[str, Any] = json.loads(raw)
    return elapsed, answer


async def run_chunk(
    http: Http, model: str, chunk: list[tuple[int, str]], concurrency: int, headers: dict[str, str] | None
) -> tuple[float, list[tuple[int, str, dict[str, Any]]]]:
    results: list[tuple[int, str, dict[str, Any]]] = []
    pending = iter(chunk)

    async def client() -> None:
        for family, text in pending:
            results.append((family, text, await infer(http, model, text, headers)))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - started, results


def fingerprint(output: dict[str, Any]) -> str:
    """What tells one text's output from another's: ``embed``'s first values, else the whole output."""
    if "embedding" in output:
        return json.dumps([round(x, 5) for x in output["embedding"][:8]])
    return json.dumps(output, sort_keys=True)


def workload_of(args: argparse.Namespace) -> list[tuple[int, str]]:
    return requests(args.requests, zipf_s=args.zipf_s, paraphrase_share=args.paraphrase_share, pool=args.pool)


def fleet_of(urls: dict[str, str], args: argparse.Namespace) -> CacheFleet:
    extra = {}
    if args.repository:
        extra["FLEET_MODEL_REPOSITORY"] = str(Path(args.repository).resolve())
    log_dir = RESULTS_DIR / f"cache-logs-{args.model}"
    return CacheFleet(urls, args.l1_entries, log_dir, args.levels, args.model, args.model_ref, extra)


async def measure_fleet(urls: dict[str, str], args: argparse.Namespace, l3: asyncio.Task[Any]) -> dict[str, Any]:
    workload = workload_of(args)
    size = -(-len(workload) // args.rounds)
    model = args.model
    with fleet_of(urls, args) as fleet:
        http = AiohttpHttp(fleet.url)  # the SDK's HTTP client: a cheap client, so the client is not the bound
        try:
            await fleet.ready(http)
            await l3  # measured while the fleet loaded its models; the rounds run alone
            cached_s = bypass_s = 0.0
            bypass_n = 0
            levels: collections.Counter[str] = collections.Counter()
            families: dict[tuple[float, ...], int] = {}
            wrong = 0
            for r in range(args.rounds):
                chunk = workload[r * size : (r + 1) * size]
                seconds, results = await run_chunk(http, model, chunk, args.concurrency, None)
                cached_s += seconds
                for family, _, record in results:
                    level = record["cache"] or "miss"
                    levels[level] += 1
                    if level == "miss":
                        families.setdefault(fingerprint(record["output"]), family)
                    elif level == "l3" and families.get(fingerprint(record["output"]), family) != family:
                        wrong += 1
                base = chunk[:: max(1, round(1 / args.baseline_share))]
                seconds, _ = await run_chunk(http, model, base, args.concurrency, BYPASS)
                bypass_s, bypass_n = bypass_s + seconds, bypass_n + len(base)
                ratio = (sum(levels.values()) / cached_s) / (bypass_n / bypass_s)
                print(f"round {r + 1}/{args.rounds}: {dict(levels)}, wrong L3 {wrong}, ratio {ratio:.2f}x", flush=True)
            hot = [text for _, text in workload[:50]]
            l1_latencies = []
            for text in hot * 6:
                elapsed, answer = await submit_latency(http, model, text)
                if answer.get("cache") == "l1":
                    l1_latencies.append(elapsed)
        finally:
            await http.aclose()
    total = sum(levels.values())
    return {
        "model": model,
        "requests": total,
        "planned_hit_rates": expected_levels(workload, args.l1_entries),
        "hit_rates": {level: levels[level] / total for level in ("l1", "l2", "l3", "miss")},
        "l3_wrong_answers": wrong,
        "cached_rps": total / cached_s,
        "bypass_rps": bypass_n / bypass_s,
        "throughput_ratio": (total / cached_s) / (bypass_n / bypass_s),
        "l1_hit_submit": percentiles_ms(l1_latencies) | {"samples": len(l1_latencies)},
    }


def meaning_groups(pairs: list[tuple[str, str, str, bool]]) -> dict[str, str]:
    """Text -> a representative of its meaning: texts of a same-meaning pair share one (a base text appears in
    several pairs, so a query may match a copy indexed for another pair; that is right when the meaning is)."""
    parent: dict[str, str] = {}

    def find(text: str) -> str:
        while parent.get(text, text) != text:
            text = parent[text]
        return text

    for _, a, b, same in pairs:
        if same:
            parent[find(b)] = find(a)
    return {text: find(text) for _, a, b, _ in pairs for text in (a, b)}


def cosine_by_kind(cos: np.ndarray, pairs: list[tuple[str, str, str, bool]]) -> dict[str, dict[str, float]]:
    out = {}
    for kind in dict.fromkeys(p[0] for p in pairs):
        values = cos[[p[0] == kind for p in pairs]]
        out[kind] = {"min": float(values.min()), "max": float(values.max())}
    return out


def measure_l3(args: argparse.Namespace) -> dict[str, Any]:
    """The labelled pairs and the lookup cost, in a 100,000-entry index (no fleet needed)."""
    pairs = labelled_pairs()
    model = load_embed_handler("cpu")
    started = time.perf_counter()
    first = np.asarray(model.embed_texts([p[1] for p in pairs]), dtype=np.float32)
    embed_ms = 1000 * (time.perf_counter() - started) / len(pairs)
    second = np.asarray(model.embed_texts([p[2] for p in pairs]), dtype=np.float32)
    index = SemanticIndex(EMBED_DIM, max_entries=args.l3_entries, nprobe=8)
    filler = np.random.default_rng(3).standard_normal((args.l3_entries - len(pairs), EMBED_DIM)).astype(np.float32)
    filler /= np.linalg.norm(filler, axis=1, keepdims=True)
    for start in range(0, len(filler), 20_000):
        rows = filler[start : start + 20_000]
        index.add(rows, [f"filler{start + i}" for i in range(len(rows))], ["filler"] * len(rows))
    index.add(first, [f"pair{i}" for i in range(len(pairs))], [p[1] for p in pairs])
    threshold = EMBED.cache_threshold
    times, hits = [], []
    for i, (_, _, query, _) in enumerate(pairs):
        started = time.perf_counter()
        match = index.search(second[i : i + 1], [query], threshold)[0]
        times.append(time.perf_counter() - started)
        hits.append(match)
    accepted = [(pairs[i], m) for i, m in enumerate(hits) if m is not None]
    group = meaning_groups(pairs)
    wrong = [p for p, m in accepted if group.get(m.text, m.text) != group.get(p[2], p[2])]
    para = [p for p in pairs if p[3]]
    cos = (first * second).sum(axis=1)
    sweep = {}
    for th in (0.85, 0.88, 0.90, 0.92, 0.93, 0.94, 0.95, 0.96):
        ok = [c >= th and texts_agree(p[2], p[1]) for c, p in zip(cos.tolist(), pairs, strict=True)]
        hit_pairs = [p for p, o in zip(pairs, ok, strict=True) if o]
        sweep[str(th)] = {
            "paraphrase_recall": sum(p[3] for p in hit_pairs) / len(para),
            "wrong_share": sum(not p[3] for p in hit_pairs) / max(1, len(hit_pairs)),
        }
    return {
        "entries": len(index),
        "trained_ivf": index.trained,
        "search_per_query": percentiles_ms(times),
        "embed_per_text_ms_batched": embed_ms,
        "threshold": threshold,
        "labelled_pairs": len(pairs),
        "paraphrase_recall": sum(1 for p, _ in accepted if p[3]) / len(para),
        "l3_hits": len(accepted),
        "wrong_hits": len(wrong),
        "wrong_share": len(wrong) / max(1, len(accepted)),
        "wrong_by_kind": dict(collections.Counter(p[0] for p in wrong)),
        "cosine_by_kind": {
            kind: {
                "min": float(cos[[p[0] == kind for p in pairs]].min()),
                "max": float(cos[[p[0] == kind for p in pairs]].max()),
            }
            for kind in dict.fromkeys(p[0] for p in pairs)
        },
        "sweep": sweep,
    }


SEEDS_MIX_NO_L3 = {"l1": 0.35, "l2": 0.28, "l3": 0.0, "miss": 0.37}  # the same without its semantic level


def ceiling(rates: dict[str, float], with_l3: bool, lookup_cost: float = 1.0) -> float:
    """The throughput ratio caches / no caches if nothing but the models cost anything.

    Without caches each request is one computation (the worker's). With them a miss is still one, and an L3
    lookup (every request that L1 and L2 missed) embeds the query in the gateway at ``lookup_cost`` of a
    computation: 1 for ``embed``, whose L3 embedder is the model itself; embed / extract for ``extract``
    (``benchmarks.stand_in_cost``). The bound is 1 / (lookup_cost x (l3 + miss) + miss) with L3 on (1 / miss
    without).
    """
    lookups = lookup_cost * (rates["l3"] + rates["miss"]) if with_l3 else 0.0
    return 1.0 / max(1e-9, lookups + rates["miss"])


def lookup_cost_of(model: str) -> float | None:
    """An L3 lookup's cost in computations of ``model``: 1 for embed, else from ``stand_in_cost``'s last result."""
    if model == "embed":
        return 1.0
    if not STAND_IN_COST.exists():
        return None
    return 1.0 / float(json.loads(STAND_IN_COST.read_text())["figures"]["ratio"])


def percents(rates: dict[str, float]) -> str:
    return " / ".join(f"{100 * rates[k]:.1f}%" for k in ("l1", "l2", "l3", "miss"))


def rows(fleet: dict[str, Any], l3: dict[str, Any], with_l3: bool = True) -> list[tuple[str, str, str]]:
    rates, l1, search = fleet["hit_rates"], fleet["l1_hit_submit"], l3["search_per_query"]
    mix = percents(rates)
    cost = lookup_cost_of(fleet.get("model", "embed"))
    bound = "-" if cost is None else f"{ceiling(rates, with_l3, cost):.2f}x"
    seeds = SEEDS_MIX if with_l3 else SEEDS_MIX_NO_L3
    seeds_bound = "-" if cost is None else f"{ceiling(seeds, with_l3, cost):.2f}x"
    ratio = f"{fleet['throughput_ratio']:.2f}x ({fleet['cached_rps']:.0f} vs {fleet['bypass_rps']:.0f} req/s)"
    wrong = f"{100 * l3['wrong_share']:.2f}% ({l3['wrong_hits']}/{l3['l3_hits']})"
    return [
        ("hit rate L1 / L2 / L3 / miss", mix, "seeds: 35 / 28 / 12 / 25"),
        ("  planned by the workload (one gateway, one at a time)", percents(fleet["planned_hit_rates"]), "-"),
        ("L3 hits answered with another text's output", str(fleet["l3_wrong_answers"]), "0"),
        ("throughput with caches / without", ratio, ">= 3x"),
        ("  ceiling of that ratio at this mix", bound, "-"),
        ("  ceiling at the seeds' mix", seeds_bound, "-"),
        ("gateway p50 of an L1 hit", f"{l1['p50_ms']:.2f} ms (p99 {l1['p99_ms']:.2f})", "< 2 ms"),
        (f"L3 search per query, {l3['entries']:,} entries", f"p50 {search['p50_ms']:.3f} ms", "< 1 ms"),
        ("L3 embedding per text (batched, apart)", f"{l3['embed_per_text_ms_batched']:.2f} ms", "-"),
        (f"labelled pairs: wrong share of L3 hits (threshold {l3['threshold']})", wrong, "< 1 %"),
        ("labelled pairs: paraphrases that hit", f"{100 * l3['paraphrase_recall']:.1f}%", "-"),
    ]


async def main(args: argparse.Namespace) -> None:
    if args.l3_only:  # the labelled pairs and the index alone, merged into the last results
        path = RESULTS_DIR / "bench_cache.json"
        last = json.loads(path.read_text()) if path.exists() else {}
        l3 = await asyncio.to_thread(measure_l3, args)
        write_result("bench_cache", {"args": last.get("args"), "fleet": last.get("fleet"), "l3": l3})
        print(json.dumps({k: v for k, v in l3.items() if k != "cosine_by_kind"}, indent=1))
        return
    l3_task = asyncio.create_task(asyncio.to_thread(measure_l3, args))
    with services(nats=True, redis=True) as urls:
        fleet = await measure_fleet(urls, args, l3_task)
    l3 = l3_task.result()
    name = "bench_cache" if args.model == "embed" else f"bench_cache_{args.model}"
    title = f"Result caches: {fleet['requests']:,} {args.model} requests, fleet gateway + worker, NATS + Redis"
    show(title, rows(fleet, l3, "l3" in args.levels))
    path = write_result(name, {"args": vars(args), "fleet": fleet, "l3": l3})
    print(f"results: {path}")


MODEL_REFS = {"embed": "embed", "extract": "extract"}
SEEDS_PRESET = {**SEEDS_WORKLOAD, "concurrency": 16, "baseline_share": 0.2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODEL_REFS), default="embed")
    parser.add_argument(
        "--model-ref",
        help="what FLEET_MODELS and the worker's --model get; default: the --model's name",
    )
    parser.add_argument("--repository", default="models", help="the model repository (FLEET_MODEL_REPOSITORY)")
    parser.add_argument("--mix", choices=["default", "seeds"], default="default", help="seeds: SEEDS_WORKLOAD")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--pool", type=int, default=None, help="draw from the first N base texts (default all)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--baseline-share", type=float, default=0.1, help="share of each chunk also run bypassed")
    parser.add_argument("--zipf-s", type=float, default=0.9)
    parser.add_argument("--paraphrase-share", type=float, default=0.25)
    parser.add_argument("--l1-entries", type=int, default=300)
    parser.add_argument("--levels", default="l1+l2+l3", help="the cache levels on (FLEET_CACHE=<model>=<levels>)")
    parser.add_argument("--l3-entries", type=int, default=100_000)
    parser.add_argument("--l3-only", action="store_true", help="measure the L3 index and labelled pairs only")
    known, _ = parser.parse_known_args(argv)
    if known.mix == "seeds":  # the preset's values, under whatever the command line gives explicitly
        parser.set_defaults(**SEEDS_PRESET)
    args = parser.parse_args(argv)
    args.model_ref = args.model_ref or MODEL_REFS[args.model]
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
