#!/usr/bin/env bash
# The fast lane (`make check`): lint, type check, and the tests that start no server and no fleet process, in a few
# minutes. Tests that start Redis, NATS, Kafka, Chromium or a fleet process are marked `services` (tests/fast_lane.py
# says how), tests that load a real model are marked `slow`; both are left to `make test`, the whole suite, which is
# what CI runs. With FLEET_FAST_LANE=1 a test that starts a server anyway fails and says how to mark it.
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
# Four workers, whole files each, on two cores: most of these tests wait (batch windows, deadlines) more than they
# compute, so a worker per core leaves the cores idle part of the time.
exec .venv/bin/python -m pytest -m "not services and not slow" -n "${FLEET_CHECK_WORKERS:-4}" --dist loadfile "$@"
