#!/usr/bin/env bash
# Create or update .venv from the committed lock file (uv.lock) with the extras named as arguments (pyproject.toml):
#   scripts/venv.sh server                      what `fleet up` needs (make up): no test, benchmark or docs tools
#   scripts/venv.sh all test bench docs         everything (make test, make bench, make docs)
# Installs are reproducible: `uv sync --frozen` installs exactly the versions in uv.lock and never re-resolves.
# One .venv serves every command: the extras installed so far are kept in the stamp, and a later command syncs the
# union of those and its own, so `make up` after `make test` neither removes the test tools nor reinstalls
# anything, and `make test` after `make up` adds only what the tests need.
# To move a dependency, change pyproject.toml and run `make lock` (docs/development.md); commit both files.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
UV_VERSION=0.13.9  # the uv that wrote uv.lock; pinned so that every machine reads the lock the same way
[ $# -gt 0 ] || set -- all test bench docs
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv" >&2
  "$PY" -m venv .venv
fi
if ! .venv/bin/uv --version 2>/dev/null | grep -qx "uv $UV_VERSION\( .*\)\?"; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
fi
stamp=.venv/.fleet-installed  # the extras installed, one a line; written after a sync that succeeded
installed=$( [ -f "$stamp" ] && cat "$stamp" || true)
wanted=$(printf '%s\n' $installed "$@" | sed '/^$/d' | sort -u)
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ uv.lock -nt "$stamp" ] || [ "$wanted" != "$installed" ]; then
  echo "==> installing Fleet with the extras $(echo $wanted | tr ' ' ,) into .venv (the models extra downloads torch: a few minutes)" >&2
  .venv/bin/uv sync --quiet --frozen $(printf -- '--extra %s ' $wanted)
  printf '%s\n' "$wanted" >"$stamp"
fi
