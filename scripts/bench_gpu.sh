#!/usr/bin/env bash
# (b) micro-batching vs batch 1 and (c) fleet vs bare transformers for `embed` on CUDA, in one short run.
# Needs only Python with Fleet's dependencies (no NATS or Redis: the embedded broker and store are used), and
# runs with random weights of the same architecture when the packaged weights are missing (same throughput).
#   bash scripts/bench_gpu.sh            # from a checkout with .venv, or with FLEET_PYTHON pointing at a Python
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${FLEET_PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c 'import sys, torch; sys.exit(0) if torch.cuda.is_available() else sys.exit("no CUDA device is visible: run this where a GPU is")'
"$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(0))'
"$PY" -m benchmarks.bench_embed --device cuda --infra memory --random-weights auto \
  --jobs 20000 --single-jobs 3000 --batch 256 --words 16 --name embed-gpu "$@"
