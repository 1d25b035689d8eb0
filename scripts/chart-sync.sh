#!/usr/bin/env bash
# chart-sync.sh — copy the files the Helm chart embeds from their sources of
# truth into charts/meshtrain/ (helm does not follow files outside a chart):
#   manifests/crd/*.yaml        -> charts/meshtrain/crds/
#   dashboards/*.json           -> charts/meshtrain/files/dashboards/
#   dashboards/rules.yaml       -> charts/meshtrain/files/rules.yaml
#   manifests/examples/*.yaml   -> charts/meshtrain/files/examples/ (shipped in the packaged
#                                  chart, so an OCI install has them: NOTES.txt says how)
# `make verify` fails when a copy differs from its source, so run this
# (make chart-sync) after changing the CRD or the dashboards.
#
# Usage: scripts/chart-sync.sh [--check]   (--check: only report differences)
set -euo pipefail
cd "$(dirname "$0")/.."
CHART=charts/meshtrain
CHECK=0
[[ "${1:-}" == "--check" ]] && CHECK=1

status=0
sync_dir() {  # sync_dir SRC_GLOB_DIR PATTERN DEST_DIR
  local src="$1" pattern="$2" dest="$3" f
  mkdir -p "$dest"
  for f in "$dest"/$pattern; do  # copies whose source is gone
    [[ -e "$f" ]] || continue
    if [[ ! -e "$src/$(basename "$f")" ]]; then
      if (( CHECK )); then echo "stale: $f"; status=1; else rm -f "$f"; echo "removed $f"; fi
    fi
  done
  for f in "$src"/$pattern; do
    [[ -e "$f" ]] || continue
    sync_file "$f" "$dest/$(basename "$f")"
  done
}
sync_file() {  # sync_file SRC DEST
  if ! cmp -s "$1" "$2"; then
    if (( CHECK )); then echo "differs: $2 (source $1)"; status=1; else cp "$1" "$2"; echo "copied $1 -> $2"; fi
  fi
}

sync_dir manifests/crd '*.yaml' "$CHART/crds"
sync_dir dashboards '*.json' "$CHART/files/dashboards"
sync_dir manifests/examples '*.yaml' "$CHART/files/examples"
if [[ -e dashboards/rules.yaml ]]; then sync_file dashboards/rules.yaml "$CHART/files/rules.yaml"; fi
exit $status
