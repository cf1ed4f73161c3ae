#!/usr/bin/env bash
# The fast lane (`make check`): lint, type check, and the tests that need no server process, in a few minutes.
# Tests that start Redis, NATS, Kafka, Chromium or a fleet server are marked `services` (tests/fast_lane.py says
# how) and left to `make test`, the whole suite, which is what CI runs. With FLEET_FAST_LANE=1 a test that starts a
# server anyway fails and says how to mark it.
#   bash scripts/check.sh [pytest arguments, e.g. tests/test_dag_spec.py -x]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
export PYTHONUNBUFFERED=1 FLEET_FAST_LANE=1
echo "==> lint: ruff" >&2
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
echo "==> types: mypy" >&2
.venv/bin/mypy
echo "==> tests that need no server process (make test runs them all)" >&2
exec .venv/bin/python -m pytest -m "not services" "$@"
