#!/usr/bin/env bash
# chart-package.sh DEST — the versioned chart archive DEST/meshtrain-VERSION.tgz.
# VERSION is meshtrain.api.release.VERSION, the one version of the package, the chart
# (version and appVersion) and the operator and trainer images' tags; packaging
# refuses a Chart.yaml that says otherwise, so a release cannot ship mixed tags.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-dist}"
version="$(sed -n 's/^VERSION = "\(.*\)"$/\1/p' meshtrain/api/release.py)"
[[ -n "$version" ]] || { echo "chart-package: no VERSION in meshtrain/api/release.py" >&2; exit 1; }
for key in version appVersion; do
  found="$(sed -n "s/^$key: *\"\{0,1\}\([^\"]*\)\"\{0,1\}$/\1/p" charts/meshtrain/Chart.yaml)"
  if [[ "$found" != "$version" ]]; then
    echo "chart-package: charts/meshtrain/Chart.yaml $key is '$found' but meshtrain.api.release.VERSION is '$version': set both to $version" >&2
    exit 1
  fi
done
scripts/chart-sync.sh --check >/dev/null || { echo "chart-package: chart copies are stale: run make chart-sync" >&2; exit 1; }
helm="${HELM:-$(scripts/bootstrap.sh --print-bin-dir)/helm}"
mkdir -p "$dest"
"$helm" package charts/meshtrain --destination "$dest" --version "$version" --app-version "$version"
