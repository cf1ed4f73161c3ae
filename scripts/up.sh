#!/usr/bin/env bash
# The README's run command: install Fleet into .venv and start everything in one process on port 8000.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh server  # what `fleet up` needs (the server extra): nothing for tests or benchmarks
exec .venv/bin/fleet up "$@"
