#!/usr/bin/env bash
# Build Fleet's container image from deploy/image/Containerfile with buildah, on a Debian base made here by
# mmdebstrap (no registry needed), and print its reference (the last line of stdout), e.g.
# localhost/fleet-inference:0.1.0. `make image` runs it; `make test` runs it before the suite (tests/test_image.py).
#
#   scripts/image/build.sh [--variant cpu|cuda] [--repository DIR] [--name NAME]
#     --variant cuda      localhost/fleet-inference:VERSION-cuda: the same layers, set up for the NVIDIA toolkit
#     --repository DIR    a model repository folder (models/<name>/<version>/...) shipped in /models
#     --name NAME         the image's name instead of localhost/fleet-inference (the tag stays the version;
#                         tests/test_image.py builds one with a model repository this way, beside the default)
#   FLEET_IMAGE_TORCH_INDEX=URL   a package index with CPU builds of torch: the cpu variant then leaves out the CUDA
#                                 wheels (uv.lock's torch is PyPI's CUDA build, which cannot load without them)
#   FLEET_IMAGE_BUDGET_MB=N       fail when the image is larger (default: the variant's budget below)
#
# Cached by content: a hash of the Containerfile, this folder, uv.lock, the package sources and the weights, kept
# with the image's id in ~/.cache/fleet/image/; when the image is still the one built for this hash nothing is
# built. Otherwise buildah's layer cache rebuilds only the layers whose inputs changed, uv's cache (mounted into the
# build) is shared with the host's, and older images of the variant are removed afterwards, so the store holds one
# of each variant and name.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
here="$root/scripts/image"
source "$here/env.sh"
variant=cpu repository="" name=localhost/fleet-inference
while [ $# -gt 0 ]; do
  case "$1" in
    --variant) variant="${2:-}"; shift 2 ;;
    --repository) repository="${2:-}"; shift 2 ;;
    --name) name="${2:-}"; shift 2 ;;
    *) echo "error: unknown argument '$1' (usage: build.sh [--variant cpu|cuda] [--repository DIR] [--name NAME])" >&2
       exit 2 ;;
  esac
done
case "$variant" in
  cpu) budget_mb=7000 tag_suffix="" ;;
  cuda) budget_mb=7000 tag_suffix="-cuda" ;;
  *) echo "error: --variant '$variant': use cpu or cuda" >&2; exit 2 ;;
esac
budget_mb="${FLEET_IMAGE_BUDGET_MB:-$budget_mb}"
torch_index="${FLEET_IMAGE_TORCH_INDEX:-}"
if [ -n "$torch_index" ] && [ "$variant" = cuda ]; then
  echo "error: FLEET_IMAGE_TORCH_INDEX is for the cpu variant (the cuda variant needs the CUDA torch of uv.lock)" >&2
  exit 2
fi
if ! [[ "$name" =~ ^[a-z0-9]+([._/-][a-z0-9]+)*$ ]]; then
  echo "error: --name '$name' is not an image name (lower-case letters, digits, '.', '_', '-', '/')" >&2
  exit 2
fi
if [ -n "$repository" ] && [ ! -d "$repository" ]; then
  echo "error: --repository '$repository' is not a folder (a model repository: models/<name>/<version>/...)" >&2
  exit 2
fi
for tool in buildah podman mmdebstrap; do
  command -v "$tool" >/dev/null || { echo "error: $tool is missing: run scripts/services.sh (apt-get install buildah podman runc mmdebstrap)" >&2; exit 1; }
done
uv="${UV:-$root/.venv/bin/uv}" python="$root/.venv/bin/python"
[ -x "$uv" ] || { echo "error: $uv is missing: run scripts/venv.sh (make venv)" >&2; exit 1; }
version=$(sed -n 's/^version = "\([^"]*\)".*/\1/p' "$root/pyproject.toml" | head -1)
ref="$name:$version$tag_suffix"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/fleet/image"
mkdir -p "$cache"

# 1. the base: Debian bookworm's minimal system with python3, once per recipe
base_recipe="bookworm minbase python3,python3-venv,ca-certificates"
base="localhost/fleet-base:bookworm-$(echo "$base_recipe" | sha256sum | cut -c1-8)"
if ! podman image exists "$base"; then
  echo "==> making the base image $base with mmdebstrap (once: about a minute)" >&2
  start=$(date +%s)
  rm -f "$cache/base.tar"
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$cache/base.tar"
  ctr=$(buildah from scratch)
  buildah add --quiet "$ctr" "$cache/base.tar" / >/dev/null
  buildah config --label io.fleet.build=fleet-inference --cmd /bin/bash "$ctr"
  buildah commit --quiet --rm "$ctr" "$base" >/dev/null
  rm -f "$cache/base.tar"
  echo "==> base image made in $(( $(date +%s) - start )) s" >&2
fi

# 2. what the image is made of, hashed: a warm run stops here
files_hash() { (cd "$1" && find . -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z \
  | xargs -0 -r sha256sum) | sha256sum | cut -c1-16; }
packages=(fleet producers consumers dispatcher autoscaler dags schemas)  # what the wheel is made of (pyproject.toml)
sources=$(for dir in "${packages[@]}"; do files_hash "$root/$dir"; done)
hash=$( {
  echo "$name $variant $torch_index $base $(podman image inspect --format '{{.Id}}' "$base")"
  cat "$root/deploy/image/Containerfile" "$root/deploy/image/healthcheck.py" "$root/uv.lock" "$root/pyproject.toml"
  cat "$here"/*.sh "$here"/*.py "$here/containers.conf"
  echo "$sources"
  [ -z "$repository" ] || files_hash "$repository"
} | sha256sum | cut -c1-16)
# The hash and the image it made live in a stamp file, not in a label: buildah's layer cache hands back a cached
# image whose labels are the first build's when only a --label differs.
stamp="$cache/$(echo "$ref" | tr '/:' '__').built"
id=$(podman image inspect --format '{{.Id}}' "$ref" 2>/dev/null || true)
if [ -z "$id" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$hash $id" ]; then
  echo "==> building $ref (content $hash) with buildah" >&2
  start=$(date +%s)
  ctx="$cache/context-$(echo "$ref" | tr '/:' '__')"
  rm -rf "$ctx" && mkdir -p "$ctx/repository" "$ctx/dist"
  "$uv" export --quiet --frozen --no-emit-project --extra all --no-header --no-annotate \
    | "$python" "$here/requirements.py" "$ctx" ${torch_index:+--cpu-torch "$(sed -n '/^name = "torch"$/{n;s/^version = "\(.*\)"/\1/p}' "$root/uv.lock")"}
  [ -z "$repository" ] || { cp -a "$repository/." "$ctx/repository/" && chmod -R a+rX "$ctx/repository"; }
  cp "$root/deploy/image/healthcheck.py" "$ctx/healthcheck.py"
  # the wheel, from a copy of the sources (setuptools' build/ folder in the checkout could hold deleted files), with
  # a fixed timestamp: the same sources make the same wheel, so the cpu and cuda variants share the code layers
  mkdir "$ctx/src"
  (cd "$root" && cp -a "${packages[@]}" pyproject.toml README.md "$ctx/src/")
  SOURCE_DATE_EPOCH=315532800 "$uv" build --quiet --wheel --out-dir "$ctx/dist" "$ctx/src" 2>&1 | grep -v '^Successfully' >&2 || true
  rm -rf "$ctx/src"
  ls "$ctx"/dist/*.whl >/dev/null
  source_url=$(git -C "$root" remote get-url origin 2>/dev/null || echo unknown)
  buildah build --quiet --layers --format docker --network host \
    --volume "$("$uv" cache dir):/opt/fleet-build/uv-cache" --volume "$(readlink -f "$uv"):/opt/fleet-build/uv:ro" \
    --volume "$(readlink -f "${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}"):/etc/ssl/certs/ca-certificates.crt:ro" \
    --build-arg BASE="$base" --build-arg TORCH_INDEX="$torch_index" --target "$variant" \
    --label org.opencontainers.image.version="$version" --label org.opencontainers.image.source="$source_url" \
    --file "$root/deploy/image/Containerfile" --tag "$ref" "$ctx" >/dev/null
  rm -rf "$ctx"
  echo "==> built $ref in $(( $(date +%s) - start )) s" >&2
  id=$(podman image inspect --format '{{.Id}}' "$ref")
  echo "$hash $id" >"$stamp"
  # older builds of this variant under this name lose their tags, then the layers only they used go
  podman images --noheading --filter "reference=$name" --filter "label=io.fleet.variant=$variant" \
    --format '{{.ID}} {{.Repository}}:{{.Tag}}' | while read -r old tagged; do
      [[ "$id" == "$old"* ]] || podman rmi "$tagged" >/dev/null 2>&1 || true
    done
  podman image prune --force --filter label=io.fleet.build=fleet-inference >/dev/null
fi

# 3. its size against the budget
size_mb=$(( $(podman image inspect --format '{{.Size}}' "$ref") / 1000000 ))
echo "==> $ref: $size_mb MB (budget $budget_mb MB)" >&2
if [ "$size_mb" -gt "$budget_mb" ]; then
  echo "error: $ref is $size_mb MB, over its budget of $budget_mb MB (FLEET_IMAGE_BUDGET_MB)" >&2
  exit 1
fi
echo "$ref"
