#!/usr/bin/env bash
# images.sh — build the operator and trainer images from operator/Dockerfile
# and trainer/Dockerfile with buildah, as a user's `docker build` would, and
# optionally push them to a registry (the sandbox's, or a release's).
#
# No container registry is reachable here, so the one thing that differs from
# a registry build is the base image argument (PYTHON_IMAGE): a local image of
# a Debian 12 rootfs with Python 3.11, made by mmdebstrap from the Debian
# mirror.  Everything else is the Dockerfiles as they are.
#
# Cached: the base image is built once per package list; buildah's layer
# cache (--layers) rebuilds only the layers whose inputs changed, and pip's
# cache is the Dockerfiles' cache mount, so a rebuild downloads no wheel.
# Images live in buildah's own store under $MESHTRAIN_CACHE/containers.
#
# The pod sandbox ("pause") image is built the same way from Kubernetes' own
# build/pause/linux/pause.c of the pinned k8s.io/kubernetes module (static,
# with the flags of its Makefile), since registry.k8s.io is not reachable.
#
# Usage:
#   scripts/images.sh                       build pause, base, operator and trainer
#   scripts/images.sh --push PREFIX         ... and push PREFIX/operator:VERSION and
#                                           PREFIX/trainer:VERSION (buildah push; PREFIX is
#                                           registry[:port]/path, e.g. ghcr.io/meshtrain)
#     --with-pause                          also push PREFIX/pause:<k8s version> (the sandbox's
#                                           nodes pull their pod sandbox image from it too)
#     --plain-http                          the registry speaks HTTP, not HTTPS (the sandbox's)
#     --zstd                                compress layers with zstd at level 1 instead of gzip:
#                                           gzip of gigabytes of CUDA libraries costs minutes of
#                                           CPU, zstd seconds (containerd >= 1.5 pulls it; a
#                                           release keeps gzip, which every runtime pulls)
#   scripts/images.sh --print-tags          print the image names, build nothing
#
# VERSION is meshtrain.api.release.VERSION, the one version of package, chart and images.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
CACHE_ROOT="${MESHTRAIN_CACHE:-$HOME/.cache/meshtrain}"
STORE="$CACHE_ROOT/containers"
VERSION="$(sed -n 's/^VERSION = "\(.*\)"$/\1/p' "$REPO/meshtrain/api/release.py")"
# The names the chart (image.repository + appVersion) and TrainingJob.spec.image default to.
OPERATOR_IMAGE="ghcr.io/meshtrain/operator:$VERSION"
TRAINER_IMAGE="ghcr.io/meshtrain/trainer:$VERSION"
K8S_VERSION="${MESHTRAIN_K8S_VERSION:-v1.36.3}"
PAUSE_IMAGE="localhost/meshtrain/pause:$K8S_VERSION"
BASE_PACKAGES="python3,python3-venv,python3-pip,python-is-python3,ca-certificates"
ROOTFS_IMAGE="localhost/meshtrain/python:bookworm-$(printf '%s' "$BASE_PACKAGES" | sha1sum | cut -c1-8)"
# The base adds this host's extra CA certificates (/usr/local/share/ca-certificates,
# e.g. a TLS-intercepting proxy's) to the rootfs, so pip in the build trusts
# what the host trusts; the tag changes when they do.
HOST_CAS=(/usr/local/share/ca-certificates/*.crt)
[[ -e "${HOST_CAS[0]}" ]] || HOST_CAS=()
BASE_IMAGE="$ROOTFS_IMAGE-ca$(cat "${HOST_CAS[@]}" /dev/null | sha1sum | cut -c1-8)"

START_SECONDS=$SECONDS
log() { printf '[images %4ds] %s\n' "$((SECONDS - START_SECONDS))" "$*" >&2; }
die() { printf 'images: error: %s\n' "$*" >&2; exit 1; }

PUSH_PREFIX=""
WITH_PAUSE=0
PUSH_FLAGS=()
PLAIN_HTTP=0
while (($#)); do
  case "$1" in
    --print-tags) echo "$OPERATOR_IMAGE $TRAINER_IMAGE $PAUSE_IMAGE"; exit 0 ;;
    --push) PUSH_PREFIX="${2:?--push needs the registry prefix, e.g. ghcr.io/meshtrain}"; shift ;;
    --with-pause) WITH_PAUSE=1 ;;
    --plain-http) PUSH_FLAGS+=(--tls-verify=false); PLAIN_HTTP=1 ;;
    --zstd) PUSH_FLAGS+=(--compression-format zstd --compression-level 1) ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed -e 's/^# \{0,1\}//' -e '/^set -euo/d'; exit 0 ;;
    *) die "unknown argument: $1 (try --help)" ;;
  esac
  shift
done

for tool in buildah mmdebstrap; do
  command -v "$tool" >/dev/null || die "$tool is missing: run scripts/bootstrap.sh (installs Debian's $tool)"
done

bah() { buildah --root "$STORE/storage" --runroot "$STORE/run" --storage-driver overlay "$@"; }

build_base() {
  local container ca
  if bah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
    log "base image present: $BASE_IMAGE"
    return
  fi
  build_rootfs
  container="$(bah from "$ROOTFS_IMAGE")"
  for ca in "${HOST_CAS[@]}"; do
    bah copy "$container" "$ca" /usr/local/share/ca-certificates/ >/dev/null
  done
  bah run --network none "$container" update-ca-certificates >/dev/null
  bah commit --quiet --rm "$container" "$BASE_IMAGE" >/dev/null
  log "built $BASE_IMAGE (${#HOST_CAS[@]} host CA certificate(s) added)"
}

build_rootfs() {
  if bah inspect --type image "$ROOTFS_IMAGE" >/dev/null 2>&1; then
    return
  fi
  local work container
  work="$(mktemp -d)"
  # shellcheck disable=SC2064  # expand now; the trap removes itself
  trap "rm -rf '$work'; trap - RETURN" RETURN
  log "building $ROOTFS_IMAGE with mmdebstrap (Debian bookworm: $BASE_PACKAGES) ..."
  mmdebstrap --quiet --variant=minbase --include="$BASE_PACKAGES" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    bookworm "$work/rootfs.tar" http://deb.debian.org/debian
  container="$(bah from scratch)"
  bah add "$container" "$work/rootfs.tar" / >/dev/null
  bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd python3 "$container"
  bah commit --quiet --rm "$container" "$ROOTFS_IMAGE" >/dev/null
  log "built $ROOTFS_IMAGE"
}

build_pause() {
  if bah inspect --type image "$PAUSE_IMAGE" >/dev/null 2>&1; then
    log "pause image present: $PAUSE_IMAGE"
    return
  fi
  local source work container
  command -v gcc >/dev/null || die "gcc is missing: run scripts/bootstrap.sh (installs Debian's gcc)"
  source="$(cd /tmp && GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
            | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')/build/pause/linux/pause.c"
  [[ -f "$source" ]] || die "could not find pause.c of k8s.io/kubernetes $K8S_VERSION in the Go module cache"
  work="$(mktemp -d)"
  # shellcheck disable=SC2064  # expand now; the trap removes itself
  trap "rm -rf '$work'; trap - RETURN" RETURN
  gcc -Os -Wall -Werror -static -DVERSION="$K8S_VERSION-meshtrain" -o "$work/pause" "$source"
  container="$(bah from scratch)"
  bah copy "$container" "$work/pause" /pause >/dev/null
  bah config --entrypoint '["/pause"]' --user 65535:65535 "$container"
  bah commit --quiet --rm "$container" "$PAUSE_IMAGE" >/dev/null
  log "built $PAUSE_IMAGE from $source"
}

# What a build reads: the Dockerfile, its .dockerignore, the base, and the
# files the .dockerignore lets into the context (its `!path` lines).
inputs_hash() {
  local dockerfile="$1" included
  included="$(sed -n 's/^!//p' "$dockerfile.dockerignore")"
  {
    cat "$dockerfile" "$dockerfile.dockerignore"
    echo "$BASE_IMAGE"
    # shellcheck disable=SC2086  # the included paths are words
    (cd "$REPO" && find $included -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 \
       | sort -z | xargs -0 sha1sum)
  } | sha1sum | cut -c1-16
}

# Skipped when the image was built from the same inputs (the store records
# inputs and image id per name): even a fully cached `buildah bud` spends
# most of a minute checking layers.
build_image() {
  local name="$1" dockerfile="$2" started=$SECONDS inputs record
  inputs="$(inputs_hash "$dockerfile")"
  record="$STORE/inputs/${name//[\/:]/_}"
  if [[ -f "$record" && "$(cat "$record")" == "$inputs $(image_id "$name")" ]]; then
    log "$name is up to date (inputs $inputs)"
    return
  fi
  log "building $name from $dockerfile ..."
  bah bud --quiet --layers --network host --ignorefile "$dockerfile.dockerignore" \
    --build-arg "PYTHON_IMAGE=$BASE_IMAGE" -f "$dockerfile" -t "$name" "$REPO" >/dev/null
  mkdir -p "$STORE/inputs"
  echo "$inputs $(image_id "$name")" >"$record"
  log "built $name in $((SECONDS - started))s ($(image_size "$name"))"
}

image_id() {
  bah inspect --type image --format '{{.FromImageID}}' "$1" 2>/dev/null || true
}

image_size() {
  bah images --format '{{.Size}}' "$1" | head -n1
}

# Pushes local image $1 to $2 (a registry reference), unless the registry already serves $2
# with this image's config (an unchanged image: buildah stages every layer it pushes, 5 GB of
# the trainer's, in a temporary file first). buildah skips the layers the registry has.
push_image() {
  local name="$1" dest="$2" started=$SECONDS
  if in_registry "$name" "$dest"; then
    log "$dest is up to date in the registry"
    return
  fi
  bah push --quiet "${PUSH_FLAGS[@]}" "$name" "docker://$dest"
  log "pushed $dest in $((SECONDS - started))s"
}

in_registry() {
  local id host path tag scheme=https
  ((PLAIN_HTTP)) && scheme=http
  id="$(image_id "$1")"
  host="${2%%/*}"; path="${2#*/}"; tag="${path##*:}"; path="${path%:*}"
  [[ -n "$id" ]] && curl -fsS --max-time 10 \
    -H 'Accept: application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json' \
    "$scheme://$host/v2/$path/manifests/$tag" 2>/dev/null | grep -q "sha256:$id"
}

mkdir -p "$STORE"
# A release pushes no pause image: only the sandbox's nodes need one.
if [[ -z "$PUSH_PREFIX" ]] || ((WITH_PAUSE)); then
  build_pause
fi
build_base
build_image "$OPERATOR_IMAGE" "$REPO/operator/Dockerfile"
build_image "$TRAINER_IMAGE" "$REPO/trainer/Dockerfile"
if [[ -n "$PUSH_PREFIX" ]]; then
  if ((WITH_PAUSE)); then
    push_image "$PAUSE_IMAGE" "$PUSH_PREFIX/pause:$K8S_VERSION"
  fi
  push_image "$OPERATOR_IMAGE" "$PUSH_PREFIX/operator:$VERSION"
  push_image "$TRAINER_IMAGE" "$PUSH_PREFIX/trainer:$VERSION"
fi
log "done in $((SECONDS - START_SECONDS))s"
