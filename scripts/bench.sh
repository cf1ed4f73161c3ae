#!/usr/bin/env bash
# Every benchmark this machine can run, one after another (benchmarks/catalogue.py lists them), each writing its
# JSON result file to benchmarks/results/; those needing a GPU or valgrind are skipped with the reason where
# missing, and a summary at the end says what ran, what was skipped and where the results are.
#   bash scripts/bench.sh [--only dag,priority] [--list]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
bash scripts/venv.sh all test bench docs
export PYTHONUNBUFFERED=1
exec .venv/bin/python -m benchmarks.run_all "$@"
