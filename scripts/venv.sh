#!/usr/bin/env bash
# Create or update .venv with Fleet and its test tools. uv keeps a download cache, so reruns are quick.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv" >&2
  "$PY" -m venv .venv
fi
if [ ! -x .venv/bin/uv ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check uv
fi
stamp=.venv/.fleet-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "==> installing Fleet and its dependencies into .venv (first run downloads torch: a few minutes)" >&2
  VIRTUAL_ENV=$PWD/.venv .venv/bin/uv pip install -q -e ".[test,bench]"
  touch "$stamp"
fi
