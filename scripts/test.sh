#!/usr/bin/env bash
# The README's test command: install what is missing, then run the whole suite against real servers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
bash scripts/venv.sh
export PYTHONUNBUFFERED=1
echo "==> lint: ruff and mypy" >&2
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
.venv/bin/mypy
echo "==> tests (real Redis, NATS JetStream and Kafka are started on free ports)" >&2
exec .venv/bin/python -m pytest "$@"
