#!/usr/bin/env bash
# Re-fetch the operator dashboard's vendored browser libraries at their pinned versions and check their sha256.
#
#   scripts/vendor_ui.sh          fetch into a temporary folder and compare with what the package ships
#   scripts/vendor_ui.sh --write  the same, then copy the fetched files into the package
#
# Packages come through `npm pack name@version` (the npm client and its configured registry; nothing else is
# contacted). To move to another version: change it below, run with --write, update the sha256 lines from the
# output, and check the page (tests/test_operator_dashboard.py).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=producers/gateway/dashboard/static/vendor

# package@version   file in the package       -> path under $DEST          sha256
FILES=(
  "uplot@1.6.32     package/dist/uPlot.iife.min.js   uplot/uPlot.iife.min.js    19c8d4c6ad88929a79f4ae49d6f7161566dfd0ba3d15cc495e974f787eb78f1f"
  "uplot@1.6.32     package/dist/uPlot.min.css       uplot/uPlot.min.css        df630c6a8d6f8eeaff264b50f73ce5b114f646ffd9a0bb74f049b0a00135fa04"
  "uplot@1.6.32     package/LICENSE                  uplot/LICENSE              8f989229699b4fe2f1a0432d0e9edc338a8a911e250e2d1b01ecd770a5f5b1bd"
  "mermaid@11.6.0   package/dist/mermaid.min.js      mermaid/mermaid.min.js     3a93016a73dc82ba890d919f9bbb176f3da9d98341650c0b517f2595cc68fef8"
  "mermaid@11.6.0   package/LICENSE                  mermaid/LICENSE            ec9fb67dcb25eccc416ed56e1aab819222c805a2a4bfe4cb19e7556bf2ffde80"
)

write=false
[ "${1:-}" = "--write" ] && write=true
command -v npm >/dev/null || { echo "error: npm is needed (apt-get install npm)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

status=0
for line in "${FILES[@]}"; do
  read -r pkg inner target sum <<<"$line"
  dir="$work/${pkg//[@\/]/_}"
  if [ ! -d "$dir" ]; then
    mkdir -p "$dir"
    (cd "$dir" && npm pack --silent "$pkg" >/dev/null && tar xzf ./*.tgz)
  fi
  got=$(sha256sum "$dir/$inner" | cut -d' ' -f1)
  if [ "$got" != "$sum" ]; then
    echo "MISMATCH $pkg $inner: fetched $got, pinned $sum" >&2
    status=1
    continue
  fi
  if $write; then
    mkdir -p "$(dirname "$DEST/$target")"
    cp "$dir/$inner" "$DEST/$target"
  fi
  shipped=$(sha256sum "$DEST/$target" 2>/dev/null | cut -d' ' -f1 || true)
  if [ "$shipped" = "$sum" ]; then
    echo "ok $pkg $target"
  else
    echo "DIFFERS $DEST/$target from the pinned $pkg (run with --write)" >&2
    status=1
  fi
done
exit $status
