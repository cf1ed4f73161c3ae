#!/usr/bin/env bash
# Make sure the servers the tests start are installed: Redis and NATS from Debian's packages, kcat for the Kafka
# interop test, Chromium for the operator dashboard's browser tests, promtool (Debian's prometheus) for the alert
# rules' tests, Jaeger (built with Go, cached) for the tracing tests, a Kubernetes control plane (etcd, kube-apiserver,
# controller manager, scheduler, kwok: built with Go once, cached) for the deploy tests, Java 17 + Maven, which fetch
# and run Apache Kafka (tests/kafka_service.py caches the jars), and buildah, podman, runc and mmdebstrap, which build
# and run Fleet's container image (scripts/image/build.sh; scripts/test.sh builds it once .venv exists).
# The test fixtures start the servers on free ports; this only installs what is missing.
set -euo pipefail
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v nats-server >/dev/null || need+=(nats-server)
command -v kcat >/dev/null || need+=(kcat)
command -v java >/dev/null || need+=(openjdk-17-jre-headless)
command -v mvn >/dev/null || need+=(maven)
command -v chromium >/dev/null || need+=(chromium)  # the operator dashboard's browser tests (Playwright drives it)
command -v promtool >/dev/null || need+=(prometheus)  # promtool: the shipped alert rules' unit tests (deploy/alerts)
for tool in buildah podman runc mmdebstrap; do  # the container image: tests/test_image.py
  command -v "$tool" >/dev/null || need+=("$tool")
done
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ] && ! command -v sudo >/dev/null; then
    echo "error: ${need[*]} missing and not root: install them with 'apt-get install ${need[*]}'" >&2
    exit 1
  fi
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  echo "==> installing ${need[*]} (Debian packages)" >&2
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
# Jaeger for the tracing tests: built from the Go module proxy once, cached (scripts/jaeger/build.sh)
bash "$(dirname "$0")/jaeger/build.sh" >/dev/null
# The Kubernetes control plane for the deploy tests (tests/kube_service.py): built from the Go module proxy once
# (about 11 minutes on 2 cores, progress on stderr), cached in a folder named for its versions (scripts/kube/build.sh)
bash "$(dirname "$0")/kube/build.sh" >/dev/null
