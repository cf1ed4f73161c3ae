#!/usr/bin/env bash
# Build a Kubernetes control plane for the deploy tests from the Go module proxy, once, into a cache folder named
# for the versions and the hash of the three go.sum files here; print that folder. It holds etcd (v3.6), kube-apiserver,
# kube-controller-manager, kube-scheduler (v1.37) and kwok (v0.7: fake nodes that run pods without containers).
# tests/kube_service.py starts them on 127.0.0.1. Each folder here is a small wrapper module whose go.mod / go.sum pin
# every module, so each machine builds the same binaries (`go install k8s.io/kubernetes/cmd/...@v1.37.2` is refused
# because that module replaces its staging modules with local folders; the wrapper replaces them with the published
# v0.37.2 ones). A cold build takes about 11 minutes on 2 cores (1.2 GB of module downloads, 4.5 GB of build cache,
# which `go clean -cache` may delete after); a warm one is a file check.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
kube=$(sed -n 's#^\s*require k8s.io/kubernetes \(v[0-9.]*\).*#\1#p; s#^\s*k8s.io/kubernetes \(v[0-9.]*\).*#\1#p' "$here/kubernetes/go.mod" | head -1)
etcd=$(sed -n 's#^\s*go.etcd.io/etcd/server/v3 \(v[0-9.]*\).*#\1#p' "$here/etcd/go.mod" | head -1)
kwok=$(sed -n 's#^\s*sigs.k8s.io/kwok \(v[0-9.]*\).*#\1#p' "$here/kwok/go.mod" | head -1)
digest=$(cat "$here"/*/go.sum | sha256sum | cut -c1-8)
out="${XDG_CACHE_HOME:-$HOME/.cache}/fleet/kube-$kube-etcd-$etcd-kwok-$kwok-$digest"
binaries=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)
missing=0
for b in "${binaries[@]}"; do [ -x "$out/$b" ] || missing=1; done
if [ "$missing" = 1 ]; then
  go=$(command -v go || echo /usr/local/go/bin/go)
  if [ ! -x "$go" ]; then
    echo "error: Go 1.26 or newer is needed to build the Kubernetes control plane for the deploy tests (https://go.dev/doc/install)" >&2
    exit 1
  fi
  mkdir -p "$out"
  exec 9>"$out/.lock"
  flock 9  # two test runs starting at once build once
  echo "==> building the Kubernetes control plane ($kube, etcd $etcd, kwok $kwok) for the deploy tests into $out (once: about 11 minutes on 2 cores)" >&2
  start=$(date +%s)
  export GOFLAGS=-mod=mod
  minor=$(echo "$kube" | cut -d. -f2)
  build() {  # build <module folder> <output> <ldflags> <package>...
    local dir=$1 target=$2 ldflags=$3; shift 3
    (cd "$here/$dir" && "$go" build -trimpath -ldflags "$ldflags" -o "$target" "$@")
  }
  [ -x "$out/etcd" ] || { build etcd "$out/etcd.tmp" "" go.etcd.io/etcd/server/v3 && mv "$out/etcd.tmp" "$out/etcd"; }
  [ -x "$out/kwok" ] || { build kwok "$out/kwok.tmp" "-X sigs.k8s.io/kwok/pkg/consts.Version=${kwok#v}" sigs.k8s.io/kwok/cmd/kwok && mv "$out/kwok.tmp" "$out/kwok"; }
  version="-X k8s.io/component-base/version.gitVersion=$kube -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
  for b in kube-apiserver kube-controller-manager kube-scheduler; do
    [ -x "$out/$b" ] || { build kubernetes "$out/$b.tmp" "$version" "k8s.io/kubernetes/cmd/$b" && mv "$out/$b.tmp" "$out/$b"; }
  done
  echo "==> Kubernetes control plane built in $(( $(date +%s) - start )) s" >&2
  for old in "$(dirname "$out")"/kube-v*-etcd-*-kwok-*; do  # earlier builds (other versions or pins): 600 MB each
    [ "$old" = "$out" ] || rm -rf "$old"
  done
fi
echo "$out"
