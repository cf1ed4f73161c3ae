#!/usr/bin/env bash
# The README's test command: install what is missing, then run the whole suite against real servers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
bash scripts/venv.sh
export PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest "$@"
