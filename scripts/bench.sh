#!/usr/bin/env bash
# Every benchmark on this machine, side by side, ratios printed and JSON in benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
bash scripts/venv.sh all test bench docs
export PYTHONUNBUFFERED=1
.venv/bin/python -m benchmarks.bench_pipeline "$@"
.venv/bin/python -m benchmarks.bench_embed --infra nats
.venv/bin/python -m benchmarks.bench_embed_fleet
.venv/bin/python -m benchmarks.bench_dispatch
.venv/bin/python -m benchmarks.bench_autoscaler
.venv/bin/python -m benchmarks.bench_cache
.venv/bin/python -m benchmarks.bench_dag
.venv/bin/python -m benchmarks.bench_adaptive
.venv/bin/python -m benchmarks.bench_priority
.venv/bin/python -m benchmarks.bench_peers
