#!/usr/bin/env bash
# The GPU checks of `embed`, in one short run:
#   0. the worker's GPU statistics: NVML devices and a CUDA model's memory against torch's (benchmarks/gpu_stats_check.py);
#   1. parity: fp16 vectors on CUDA against fp32 vectors on the CPU (lowest cosine must be >= 0.999);
#   2. (b) micro-batching vs batch 1 and (c) fleet vs bare transformers, one in-process worker, embedded broker;
#   3. N = 1, 2, 4, 8 `fleet worker` processes sharing the GPU over NATS + Redis, against the bare loop
#      (services from FLEET_BENCH_NATS_URL / FLEET_BENCH_REDIS_URL, else started as the tests start them).
# Needs only Python with Fleet's dependencies, and runs with random weights of the same architecture when the
# packaged weights are missing (same throughput).
#   bash scripts/bench_gpu.sh            # from a checkout with .venv, or with FLEET_PYTHON pointing at a Python
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${FLEET_PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c 'import sys, torch; sys.exit(0) if torch.cuda.is_available() else sys.exit("no CUDA device is visible: run this where a GPU is")'
"$PY" -c 'import torch, transformers; print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| transformers", transformers.__version__)'
"$PY" -m benchmarks.gpu_stats_check
parity=0
"$PY" -m benchmarks.gpu_parity --device cuda || parity=$?  # reported at the end; the throughput runs still go
"$PY" -m benchmarks.bench_embed --device cuda --infra memory --random-weights auto \
  --jobs 20000 --single-jobs 3000 --batch 256 --words 16 --name embed-gpu
"$PY" -m benchmarks.bench_embed_fleet --device cuda --random-weights auto \
  --workers 1,2,4,8 --jobs 100000 --batch 256 --words 16 --name embed-gpu-fleet
[ "$parity" = 0 ] || { echo "embed parity check FAILED (see above)" >&2; exit "$parity"; }
