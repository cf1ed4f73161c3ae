#!/usr/bin/env bash
# Build Jaeger v1.75.0 (all-in-one: an OTLP receiver, in-memory storage and the query API) from the Go module proxy,
# once, into a cache folder named for go.sum's hash; print the binary's path. The tracing tests start it
# (tests/jaeger_service.py). go.mod / go.sum here pin every module, so each machine builds the same binary.
# A cold build takes a few minutes (downloads and compiles); a warm one is a file check.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
version=$(sed -n 's#^\s*github.com/jaegertracing/jaeger v\([0-9.]*\).*#\1#p' "$here/go.mod" | head -1)
digest=$(sha256sum "$here/go.sum" | cut -c1-8)
out="${XDG_CACHE_HOME:-$HOME/.cache}/fleet/jaeger-$version-$digest"
if [ ! -x "$out/jaeger" ]; then
  if ! command -v go >/dev/null; then
    echo "error: Go 1.24 or newer is needed to build Jaeger for the tracing tests (https://go.dev/doc/install)" >&2
    exit 1
  fi
  mkdir -p "$out"
  echo "==> building Jaeger $version for the tracing tests into $out (once: a few minutes)" >&2
  start=$(date +%s)
  (cd "$here" && GOFLAGS=-mod=mod go build -trimpath -o "$out/jaeger.tmp" github.com/jaegertracing/jaeger/cmd/jaeger)
  mv "$out/jaeger.tmp" "$out/jaeger"
  echo "==> Jaeger built in $(( $(date +%s) - start )) s" >&2
fi
echo "$out/jaeger"
