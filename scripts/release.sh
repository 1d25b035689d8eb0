#!/usr/bin/env bash
# release.sh PREFIX [--plain-http] — build both images and the chart, tag them with the one
# version (meshtrain.api.release.VERSION) and push them to PREFIX, a registry path such as
# ghcr.io/meshtrain (`make release REGISTRY=...`; .github/workflows/release.yml on a tag):
#
#   PREFIX/operator:VERSION, PREFIX/trainer:VERSION   scripts/images.sh --push (buildah)
#   oci://PREFIX/charts/meshtrain, version VERSION    scripts/chart-package.sh, then helm push
#
# --plain-http: the registry speaks HTTP (the sandbox's, which the e2e test releases to).
# Log in first where the registry wants it (buildah login, helm registry login). helm is
# $HELM, else the bootstrap's, else the one on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix="${1:?usage: scripts/release.sh PREFIX [--plain-http]   (PREFIX: registry[:port]/path, e.g. ghcr.io/meshtrain)}"
shift
image_flags=()
helm_flags=()
for arg in "$@"; do
  case "$arg" in
    --plain-http) image_flags+=(--plain-http); helm_flags+=(--plain-http) ;;
    *) echo "release: unknown argument: $arg" >&2; exit 2 ;;
  esac
done
[[ "$prefix" != *://* && "$prefix" != */ ]] \
  || { echo "release: PREFIX is registry[:port]/path without a scheme or a trailing /, e.g. ghcr.io/meshtrain (got '$prefix')" >&2; exit 2; }
version="$(sed -n 's/^VERSION = "\(.*\)"$/\1/p' meshtrain/api/release.py)"
helm="${HELM:-$(scripts/bootstrap.sh --print-bin-dir)/helm}"
[[ -x "$helm" ]] || helm="$(command -v helm)" || { echo "release: helm is missing: run scripts/bootstrap.sh" >&2; exit 1; }
export HELM="$helm"
started=$SECONDS
scripts/images.sh --push "$prefix" "${image_flags[@]}"
scripts/chart-package.sh dist
"$helm" push "dist/meshtrain-$version.tgz" "oci://$prefix/charts" "${helm_flags[@]}"
echo "release: pushed $prefix/operator:$version, $prefix/trainer:$version and oci://$prefix/charts/meshtrain $version in $((SECONDS - started))s" >&2
