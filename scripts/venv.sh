#!/usr/bin/env bash
# Create or update .venv from the committed lock file (uv.lock), with Fleet and its test, benchmark and docs tools.
# Installs are reproducible: `uv sync --frozen` installs exactly the versions in uv.lock and never re-resolves.
# To move a dependency, change pyproject.toml and run `make lock` (docs/development.md); commit both files.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
UV_VERSION=0.13.9  # the uv that wrote uv.lock; pinned so that every machine reads the lock the same way
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv" >&2
  "$PY" -m venv .venv
fi
if ! .venv/bin/uv --version 2>/dev/null | grep -qx "uv $UV_VERSION\( .*\)\?"; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
fi
stamp=.venv/.fleet-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ uv.lock -nt "$stamp" ]; then
  echo "==> installing Fleet and its locked dependencies into .venv (first run downloads torch: a few minutes)" >&2
  .venv/bin/uv sync --quiet --frozen --extra test --extra bench --extra docs
  touch "$stamp"
fi
