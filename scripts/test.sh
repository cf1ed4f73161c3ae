#!/usr/bin/env bash
# The README's test command: install what is missing, then run the whole suite against real servers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
bash scripts/venv.sh all test bench docs
# Fleet's container image (tests/test_image.py runs it): built once per content, here rather than inside a test's
# timeout (a cold build takes a few minutes, a warm one a fraction of a second)
bash scripts/image/build.sh >/dev/null
export PYTHONUNBUFFERED=1
echo "==> uv.lock agrees with pyproject.toml" >&2
if ! .venv/bin/uv lock --check --quiet; then
  echo "error: uv.lock does not match pyproject.toml's dependencies: run 'make lock' and commit uv.lock" >&2
  exit 1
fi
echo "==> lint: ruff and mypy" >&2
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
.venv/bin/mypy
echo "==> tests in two workers (each starts real Redis, NATS JetStream and Kafka on free ports)" >&2
# Two pytest-xdist workers, one per core, each taking whole files (module fixtures stay shared within a file).
exec .venv/bin/python -m pytest -n "${FLEET_TEST_WORKERS:-2}" --dist loadfile "$@"
