#!/usr/bin/env bash
# bootstrap.sh — provide the real Kubernetes control-plane binaries the tests
# and the local sandbox run against, plus helm and Prometheus.
#
# What it does:
#   * kube-apiserver, kube-controller-manager, kube-scheduler, kubectl: built
#     from the k8s.io/kubernetes Go module of ONE pinned release. A throw-away
#     wrapper module (under the cache dir, never in the repo) requires
#     k8s.io/kubernetes and pins every k8s.io/* staging module with `replace`
#     to the matching v0.X.Y tag. The replace list is read from that release's
#     own go.mod (its `k8s.io/... => ./staging/...` lines), not typed here.
#   * etcd: built from go.etcd.io/etcd/server/v3 at the version that Kubernetes
#     release recommends (its build/dependencies.yaml).
#   * helm: built from helm.sh/helm/v3/cmd/helm at HELM_VERSION.
#   * the node (the sandbox's real nodes): kubelet and kube-proxy from the same
#     k8s.io/kubernetes wrapper module; containerd, containerd-shim-runc-v2 and
#     ctr from github.com/containerd/containerd/v2 at CONTAINERD_VERSION
#     (Kubernetes 1.36 needs containerd 2.x; Debian 12 ships 1.6); CoreDNS from
#     github.com/coredns/coredns at COREDNS_VERSION; the NetworkPolicy enforcer
#     kube-router from github.com/cloudnativelabs/kube-router/v2 at
#     KUBE_ROUTER_VERSION (the bridge CNI enforces none); runc, the CNI plugins,
#     buildah, mmdebstrap, iptables, ipset and gcc from Debian (apt-get).
#   * prometheus/promtool: Debian's `prometheus` package (service left stopped).
#   * the Prometheus Operator's PodMonitor, ServiceMonitor and PrometheusRule
#     CRDs, from the github.com/prometheus-operator/prometheus-operator Go
#     module at PROMETHEUS_OPERATOR_VERSION (its example/prometheus-operator-crd
#     files), so the chart's monitoring objects are dry-run against the real
#     schemas. They land in $CACHE_ROOT/crds/prometheus-operator-<version>/.
#   * NVIDIA's ComputeDomain CRD (computedomains.resource.nvidia.com), from the
#     github.com/NVIDIA/k8s-dra-driver-gpu Go module at NVIDIA_DRA_DRIVER_VERSION
#     (a pseudo-version of its v25.8.1 tag: the module's v25 tags carry no /v25
#     path; nothing compiled), into $CACHE_ROOT/crds/nvidia-dra-driver-gpu-<version>/,
#     so the operator's ComputeDomains are created against the real schema
#     (make test-nvidia-crd). Node only; a proxy that refuses the module is
#     reported and does not stop the rest of the bootstrap.
#   * versitygw, the S3-compatible server the object-storage tests start (its
#     posix backend serves a directory), from github.com/versity/versitygw at
#     VERSITYGW_VERSION into $CACHE_ROOT/versitygw-<version>/bin/.
#   * the container registry the sandbox pushes the images and the chart to and
#     its kubelets pull from: the CNCF distribution registry, from
#     github.com/distribution/distribution/v3/cmd/registry at REGISTRY_VERSION,
#     into $CACHE_ROOT/registry-<version>/bin/ (node only).
#   * the sandbox's simulated GPU DRA driver (a kubelet plugin publishing 8
#     GPUs per node as ResourceSlices): the repository's own Go module
#     sandbox/dra-driver, on k8s.io/dynamic-resource-allocation at the staging
#     version of the Kubernetes release (v0.X.Y), into
#     $CACHE_ROOT/dra-driver-<v0.X.Y>/bin/ (node only; ~3 min on 2 cores with
#     the Kubernetes modules already downloaded, rebuilt when its sources change).
#   * scheduler-plugins' kube-scheduler (the Coscheduling plugin, a second
#     scheduler the gang-backend tests run beside kube-scheduler) and its
#     PodGroup CRD (scheduling.x-k8s.io), from sigs.k8s.io/scheduler-plugins at
#     SCHEDULER_PLUGINS_VERSION into $CACHE_ROOT/scheduler-plugins-<version>/
#     (node only). Its k8s.io deps are pinned with the `replace` lines of the
#     module's own go.mod, as build_kubernetes pins the staging modules.
#   * KWOK's `kwok` controller, which simulates the fleet benchmarks' GPU nodes
#     and their pods' lifecycles (benchmarks/fleet), from sigs.k8s.io/kwok at
#     KWOK_VERSION into $CACHE_ROOT/kwok-<version>/bin/ (node only).
#
# What it is not: a cluster installer. It only provides binaries.
#
# Binaries land in ${MESHTRAIN_CACHE:-$HOME/.cache/meshtrain}/bin/<k8s-version>/
# next to a `versions` file. A second run builds nothing. Binaries found in
# $KUBEBUILDER_ASSETS or on PATH at the pinned version are linked, not rebuilt.
#
# Usage:
#   scripts/bootstrap.sh                  build/verify everything, print bin dir
#   scripts/bootstrap.sh --print-bin-dir  print the bin dir only, build nothing
#   scripts/bootstrap.sh --no-prometheus  skip the apt step for prometheus
#   scripts/bootstrap.sh --no-node        skip the node components (kubelet, containerd, ...)
#
# Environment:
#   MESHTRAIN_K8S_VERSION   Kubernetes release (default below)
#   MESHTRAIN_CACHE         cache root (default $HOME/.cache/meshtrain)
#   KUBEBUILDER_ASSETS      directory with prebuilt binaries to reuse
set -euo pipefail

K8S_VERSION="${MESHTRAIN_K8S_VERSION:-v1.36.3}"
HELM_VERSION="${MESHTRAIN_HELM_VERSION:-v3.22.0}"
PROMETHEUS_OPERATOR_VERSION="${MESHTRAIN_PROMETHEUS_OPERATOR_VERSION:-v0.85.0}"
KUEUE_VERSION="${MESHTRAIN_KUEUE_VERSION:-v0.17.0}"
CONTAINERD_VERSION="${MESHTRAIN_CONTAINERD_VERSION:-v2.4.2}"
COREDNS_VERSION="${MESHTRAIN_COREDNS_VERSION:-v1.15.0}"
KUBE_ROUTER_VERSION="${MESHTRAIN_KUBE_ROUTER_VERSION:-v2.1.0}"
VERSITYGW_VERSION="${MESHTRAIN_VERSITYGW_VERSION:-v1.8.0}"
REGISTRY_VERSION="${MESHTRAIN_REGISTRY_VERSION:-v3.1.2}"
NVIDIA_DRA_DRIVER_VERSION="${MESHTRAIN_NVIDIA_DRA_DRIVER_VERSION:-v0.0.0-20251216103315-fc69d9852802}"
# The newest scheduler-plugins tag the module proxy serves here (v0.35.0 is refused); built
# against its own Kubernetes v1.34.1 libraries, it schedules on the v1.36 control plane (skew 2).
SCHEDULER_PLUGINS_VERSION="${MESHTRAIN_SCHEDULER_PLUGINS_VERSION:-v0.34.1-devel}"
KWOK_VERSION="${MESHTRAIN_KWOK_VERSION:-v0.8.0}"
CACHE_ROOT="${MESHTRAIN_CACHE:-$HOME/.cache/meshtrain}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN_DIR="$CACHE_ROOT/bin/$K8S_VERSION"
BUILD_ROOT="$CACHE_ROOT/build"
KUBE_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
NODE_KUBE_BINARIES=(kubelet kube-proxy)
CONTAINERD_BINARIES=(containerd containerd-shim-runc-v2 ctr)
# Debian packages of the node: the OCI runtime, CNI plugins (/usr/lib/cni),
# the image builder, the base image's rootfs builder, a C compiler with a
# static libc for Kubernetes' pause.c (the pod sandbox image), and ipset for
# kube-router's NetworkPolicy firewall.
NODE_DEBIAN_PACKAGES=(runc containernetworking-plugins buildah mmdebstrap iptables gcc libc6-dev ipset)
MONITORING_CRD_DIR="$CACHE_ROOT/crds/prometheus-operator-$PROMETHEUS_OPERATOR_VERSION"
MONITORING_CRDS=(podmonitors servicemonitors prometheusrules)
NVIDIA_CRD_DIR="$CACHE_ROOT/crds/nvidia-dra-driver-gpu-$NVIDIA_DRA_DRIVER_VERSION"
NVIDIA_CRD_FILE=resource.nvidia.com_computedomains.yaml

WITH_PROMETHEUS=1
WITH_NODE=1
for arg in "$@"; do
  case "$arg" in
    --print-bin-dir) echo "$BIN_DIR"; exit 0 ;;
    --no-prometheus) WITH_PROMETHEUS=0 ;;
    --no-node) WITH_NODE=0 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed -e 's/^# \{0,1\}//' -e '/^set -euo/d'; exit 0 ;;
    *) echo "bootstrap: unknown argument: $arg (try --help)" >&2; exit 2 ;;
  esac
done

START_SECONDS=$SECONDS
log() { printf '[bootstrap %4ds] %s\n' "$((SECONDS - START_SECONDS))" "$*"; }
die() { printf 'bootstrap: error: %s\n' "$*" >&2; exit 1; }

# --- versions reported by each binary -------------------------------------

# Prints the version a binary reports, in the same spelling as our pins
# (v1.36.3, 3.6.8, v3.22.0), or nothing if it cannot tell.
reported_version() {
  local name="$1" path="$2" out
  case "$name" in
    kubectl) out="$("$path" version --client 2>/dev/null | sed -n 's/^Client Version: //p')" ;;
    kube-*|kubelet) out="$("$path" --version 2>/dev/null | sed -n 's/^Kubernetes //p')" ;;
    containerd|ctr) out="$("$path" --version 2>/dev/null | sed -n 's/^.* \(v[0-9][^ ]*\).*$/\1/p')" ;;
    containerd-shim-runc-v2) out="$("$path" -v 2>/dev/null | sed -n 's/^[[:space:]]*Version:[[:space:]]*//p')" ;;
    coredns) out="$("$path" -version 2>/dev/null | sed -n 's/^CoreDNS-\([0-9.]*\)$/v\1/p')" ;;
    etcd)    out="$("$path" --version 2>/dev/null | sed -n 's/^etcd Version: //p')" ;;
    helm)    out="$("$path" version --short 2>/dev/null | sed 's/+.*//')" ;;
  esac
  echo "${out:-}"
}

wanted_version() {
  case "$1" in
    kube-*|kubectl|kubelet) echo "$K8S_VERSION" ;;
    containerd*|ctr) echo "$CONTAINERD_VERSION" ;;
    coredns)        echo "$COREDNS_VERSION" ;;
    etcd)           echo "${ETCD_VERSION:-}" ;;
    helm)           echo "$HELM_VERSION" ;;
  esac
}

# True when $BIN_DIR/<name> exists and reports the pinned version. When it
# does not, a binary from KUBEBUILDER_ASSETS or PATH at the pinned version is
# linked into $BIN_DIR instead (and counts as present).
have_binary() {
  local name="$1" want candidate
  want="$(wanted_version "$name")"
  [[ -n "$want" ]] || return 1
  if [[ -x "$BIN_DIR/$name" && "$(reported_version "$name" "$BIN_DIR/$name")" == "$want" ]]; then
    return 0
  fi
  for candidate in "${KUBEBUILDER_ASSETS:+$KUBEBUILDER_ASSETS/$name}" "$(command -v "$name" || true)"; do
    [[ -n "$candidate" && -x "$candidate" ]] || continue
    [[ "$(readlink -f "$candidate")" == "$(readlink -f "$BIN_DIR/$name" 2>/dev/null)" ]] && continue
    if [[ "$(reported_version "$name" "$candidate")" == "$want" ]]; then
      mkdir -p "$BIN_DIR"
      ln -sfn "$(readlink -f "$candidate")" "$BIN_DIR/$name"
      log "$name: using existing $candidate ($want)"
      return 0
    fi
  done
  return 1
}

# --- Go toolchain -----------------------------------------------------------

require_go() {
  command -v go >/dev/null 2>&1 || die "Go is missing: 'go' is not on PATH.
  Building the Kubernetes binaries needs Go >= ${1:-1.26} (the version the
  Kubernetes release's go.mod states). Debian's 'apt-get install golang' is too
  old; install Go from https://go.dev/dl/ (or the distro's backports) and put
  its bin directory on PATH, then run scripts/bootstrap.sh again."
}

# Fails unless the local Go is at least $1 (e.g. 1.26.0).
require_go_at_least() {
  local need="$1" have
  have="$(go env GOVERSION)"; have="${have#go}"
  if [[ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -n1)" != "$need" ]]; then
    die "Go $have is too old: Kubernetes $K8S_VERSION needs Go >= $need.
  Debian's 'apt-get install golang' is too old; install Go >= $need from
  https://go.dev/dl/ (or the distro's backports) and run this script again."
  fi
}

# Prints the directory of a downloaded module, or fails with the list of
# versions the module proxy does have.
module_dir() {
  local module="$1" version="$2" json
  if ! json="$(go mod download -json "$module@$version" 2>&1)" || ! grep -q '"Dir"' <<<"$json"; then
    local latest
    latest="$(go list -m -versions "$module" 2>/dev/null | tr ' ' '\n' | tail -n +2 \
              | grep -v -- '-' | sort -V | tail -n 5 | tr '\n' ' ')"
    die "version $version of $module does not exist on the Go module proxy ($(go env GOPROXY)).
  Latest available: ${latest:-(could not list versions)}
  Set the matching MESHTRAIN_*_VERSION to one of them."
  fi
  sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$json"
}

# --- building -----------------------------------------------------------------

# Writes a wrapper module to $1: `module`, `go`, requires ($3), replaces ($4).
write_wrapper() {
  local dir="$1" go_line="$2" requires="$3" replaces="$4"
  mkdir -p "$dir"
  {
    echo "// Generated by meshtrain scripts/bootstrap.sh; safe to delete."
    echo "module meshtrain.local/build"
    echo
    echo "go $go_line"
    echo
    printf 'require (\n%s\n)\n' "$requires"
    if [[ -n "$replaces" ]]; then printf '\nreplace (\n%s\n)\n' "$replaces"; fi
  } >"$dir/go.mod"
}

# Builds package $3 inside wrapper module $2 into $BIN_DIR/$1 with ldflags $4.
build_binary() {
  local name="$1" wrapper="$2" package="$3" ldflags="$4" started=$SECONDS ticker
  log "building $name from $package ..."
  ( while sleep 60; do log "  ... still building $name ($((SECONDS - started))s)"; done ) &
  ticker=$!
  if ! (cd "$wrapper" && CGO_ENABLED=0 GOFLAGS="-mod=mod" GOTOOLCHAIN=local \
          go build -trimpath -tags "${BUILD_TAGS:-}" -ldflags "-s -w $ldflags" \
            -o "$BIN_DIR/.$name.tmp" "$package"); then
    kill "$ticker" 2>/dev/null; wait "$ticker" 2>/dev/null || true
    die "building $name failed (wrapper module: $wrapper)"
  fi
  kill "$ticker" 2>/dev/null; wait "$ticker" 2>/dev/null || true
  mv -f "$BIN_DIR/.$name.tmp" "$BIN_DIR/$name"
  log "built $name in $((SECONDS - started))s ($(du -h "$BIN_DIR/$name" | cut -f1))"
}

# Version stamps, the same variables kubernetes' hack/lib/version.sh sets.
kube_ldflags() {
  local major minor flags="" key val pkg
  major="${K8S_VERSION#v}"; major="${major%%.*}"
  minor="${K8S_VERSION#v*.}"; minor="${minor%%.*}"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    for key in gitVersion=$K8S_VERSION gitMajor=$major gitMinor=$minor gitTreeState=clean \
               buildDate=1970-01-01T00:00:00Z; do
      flags+=" -X $pkg.${key%%=*}=${key#*=}"
    done
  done
  echo "$flags"
}

build_kubernetes() {
  local kube_dir="$1" wrapper="$BUILD_ROOT/kubernetes-$K8S_VERSION" staging_version replaces name
  staging_version="v0.${K8S_VERSION#v1.}"
  # Derive the pins from the release's own go.mod: every `k8s.io/x => ./staging/...`
  # becomes `k8s.io/x => k8s.io/x v0.X.Y`.
  replaces="$(sed -n 's#^[[:space:]]*\(k8s\.io/[^ ]*\) => \./staging/.*$#\t\1 => \1 '"$staging_version"'#p' \
              "$kube_dir/go.mod")"
  [[ -n "$replaces" ]] || die "found no staging replaces in $kube_dir/go.mod"
  log "pinning $(wc -l <<<"$replaces") k8s.io staging modules to $staging_version"
  write_wrapper "$wrapper" "$(sed -n 's/^go //p' "$kube_dir/go.mod")" \
    "$(printf '\tk8s.io/kubernetes %s\n' "$K8S_VERSION")" "$replaces"
  for name in "${KUBE_BINARIES[@]}" "${NODE_KUBE_BINARIES[@]}"; do
    have_binary "$name" && continue
    build_binary "$name" "$wrapper" "k8s.io/kubernetes/cmd/$name" "$(kube_ldflags)"
  done
}

build_etcd() {
  local wrapper="$BUILD_ROOT/etcd-v$ETCD_VERSION" etcd_dir
  etcd_dir="$(module_dir go.etcd.io/etcd/server/v3 "v$ETCD_VERSION")"
  write_wrapper "$wrapper" "$(sed -n 's/^go //p' "$etcd_dir/go.mod")" \
    "$(printf '\tgo.etcd.io/etcd/server/v3 v%s\n' "$ETCD_VERSION")" ""
  build_binary etcd "$wrapper" go.etcd.io/etcd/server/v3 ""
}

build_helm() {
  local wrapper="$BUILD_ROOT/helm-$HELM_VERSION" helm_dir kube_minor
  helm_dir="$(module_dir helm.sh/helm/v3 "$HELM_VERSION")"
  write_wrapper "$wrapper" "$(sed -n 's/^go //p' "$helm_dir/go.mod")" \
    "$(printf '\thelm.sh/helm/v3 %s\n' "$HELM_VERSION")" ""
  # helm's Makefile stamps the Kubernetes version its client-go speaks.
  kube_minor="$(sed -n 's#^[[:space:]]*k8s.io/client-go v0\.\([0-9]*\)\..*#\1#p' "$helm_dir/go.mod")"
  build_binary helm "$wrapper" helm.sh/helm/v3/cmd/helm \
    "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean \
     -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$kube_minor \
     -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$kube_minor"
}

# --- Kueue ----------------------------------------------------------------------

# Builds package $5 of Go module $3 at version $4 into $1/bin/$2 (ldflags $6) and leaves the
# module's directory in MODULE_ROOT. The checksum database has no record of the modules built
# this way, so Go is told not to ask it for that module alone; go.sum still pins the hash of
# what was downloaded.
build_from_module() {
  local root="$1" name="$2" module="$3" version="$4" package="$5" ldflags="$6"
  local wrapper="$BUILD_ROOT/$name-$version"
  require_go
  export GONOSUMDB="${GONOSUMDB:+$GONOSUMDB,}$module"
  MODULE_ROOT="$(module_dir "$module" "$version")"
  write_wrapper "$wrapper" "$(sed -n 's/^go //p' "$MODULE_ROOT/go.mod")" \
    "$(printf '\t%s %s\n' "$module" "$version")" ""
  mkdir -p "$root/bin"
  BIN_DIR="$root/bin" build_binary "$name" "$wrapper" "$package" "$ldflags"
}

# Kueue's controller manager, its CRDs and its webhook configurations, from the
# sigs.k8s.io/kueue module, into $CACHE_ROOT/kueue-<version>/ (the Kueue
# integration tests install them on their control plane).
build_kueue() {
  local root="$CACHE_ROOT/kueue-$KUEUE_VERSION" kueue_dir
  if [[ -x "$root/bin/kueue" && -s "$root/webhooks.yaml" ]] && compgen -G "$root/crds/*.yaml" >/dev/null; then
    log "Kueue $KUEUE_VERSION present: $root"
    return
  fi
  build_from_module "$root" kueue sigs.k8s.io/kueue "$KUEUE_VERSION" sigs.k8s.io/kueue/cmd/kueue \
    "-X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION"
  kueue_dir="$MODULE_ROOT"
  mkdir -p "$root/crds"
  cp "$kueue_dir"/config/components/crd/bases/kueue.x-k8s.io_*.yaml "$root/crds/"
  cp "$kueue_dir/config/components/webhook/manifests.yaml" "$root/webhooks.yaml"
  chmod u+w "$root"/crds/*.yaml "$root/webhooks.yaml"  # the module cache is read-only
  log "Kueue $KUEUE_VERSION: $root"
}

# kube-router, whose network policy controller the sandbox's node runs beside kube-proxy as its
# NetworkPolicy enforcer (the bridge CNI enforces none), from its Go module into
# $CACHE_ROOT/kube-router-<version>/bin/. It needs iptables, ipset and the physdev match, which
# every kernel the sandbox runs on has (kube-network-policies needs nft_queue, which some lack).
# Node only, so `make test`'s --no-node bootstrap skips it.
build_kube_router() {
  local root="$CACHE_ROOT/kube-router-$KUBE_ROUTER_VERSION"
  if [[ -x "$root/bin/kube-router" ]]; then
    log "kube-router $KUBE_ROUTER_VERSION present: $root"
    return
  fi
  build_from_module "$root" kube-router github.com/cloudnativelabs/kube-router/v2 \
    "$KUBE_ROUTER_VERSION" github.com/cloudnativelabs/kube-router/v2/cmd/kube-router ""
}

# versitygw, a real S3-compatible gateway (its posix backend serves a directory), from its Go
# module into $CACHE_ROOT/versitygw-<version>/bin/. The object-storage tests (make test) start it
# on loopback (tests/s3server.py), so --no-node builds it too.
build_versitygw() {
  local root="$CACHE_ROOT/versitygw-$VERSITYGW_VERSION"
  if [[ -x "$root/bin/versitygw" ]]; then
    log "versitygw $VERSITYGW_VERSION present: $root"
    return
  fi
  build_from_module "$root" versitygw github.com/versity/versitygw "$VERSITYGW_VERSION" \
    github.com/versity/versitygw/cmd/versitygw \
    "-X main.Version=$VERSITYGW_VERSION -X main.Build=$VERSITYGW_VERSION -X main.BuildTime=1970-01-01T00:00:00Z"
}

# The CNCF distribution registry (the OCI registry behind Docker Hub and most private ones),
# from its Go module into $CACHE_ROOT/registry-<version>/bin/: the sandbox serves it on its
# nodes' link (plain HTTP), pushes the images and the chart there, and its kubelets pull from
# it. Node only, like kube-router. The version stamp is the one its Makefile sets.
build_registry() {
  local root="$CACHE_ROOT/registry-$REGISTRY_VERSION"
  if [[ -x "$root/bin/registry" ]]; then
    log "registry $REGISTRY_VERSION present: $root"
    return
  fi
  build_from_module "$root" registry github.com/distribution/distribution/v3 "$REGISTRY_VERSION" \
    github.com/distribution/distribution/v3/cmd/registry \
    "-X github.com/distribution/distribution/v3/version.version=$REGISTRY_VERSION \
     -X github.com/distribution/distribution/v3/version.revision=$REGISTRY_VERSION"
}

# The sandbox's simulated GPU DRA driver, from the repository's own module sandbox/dra-driver
# (docs/operator.md, "DRA in the sandbox"), into $CACHE_ROOT/dra-driver-<staging version>/bin/.
# Its go.mod must pin k8s.io/dynamic-resource-allocation at the Kubernetes release's staging
# version. A `source.sha256` beside the binary records the sources it was built from: changed
# sources are rebuilt, and the sandbox refuses a stale binary. Node only.
build_dra_driver() {
  local staging_version="v0.${K8S_VERSION#v1.}" source="$REPO_ROOT/sandbox/dra-driver" root hash pinned
  root="$CACHE_ROOT/dra-driver-$staging_version"
  hash="$(dra_driver_source_hash "$source")"
  if [[ -x "$root/bin/dra-driver" && "$(cat "$root/source.sha256" 2>/dev/null)" == "$hash" ]]; then
    log "dra-driver ($staging_version) present: $root"
    return
  fi
  pinned="$(sed -n 's#^[[:space:]]*k8s\.io/dynamic-resource-allocation \(v[^ ]*\)$#\1#p' "$source/go.mod")"
  [[ "$pinned" == "$staging_version" ]] || die "sandbox/dra-driver/go.mod pins k8s.io/dynamic-resource-allocation ${pinned:-(none)}, not $staging_version (Kubernetes $K8S_VERSION).
  Set every k8s.io/* require there to $staging_version and run \`go mod tidy\` in sandbox/dra-driver."
  require_go
  mkdir -p "$root/bin"
  BIN_DIR="$root/bin" build_binary dra-driver "$source" . ""
  echo "$hash" >"$root/source.sha256"
}

# sha256 of the driver module's go.mod, go.sum and *.go, in that order (byte-sorted names);
# meshtrain.sandbox.dra computes the same to tell a stale binary.
dra_driver_source_hash() {
  local dir="$1"
  (cd "$dir" && cat go.mod go.sum $(LC_ALL=C ls -1 -- *.go) | sha256sum | cut -d' ' -f1)
}

# scheduler-plugins' scheduler (kube-scheduler with its out-of-tree plugins, Coscheduling among
# them) and its PodGroup CRD, from the sigs.k8s.io/scheduler-plugins module into
# $CACHE_ROOT/scheduler-plugins-<version>/ (bin/kube-scheduler, crds/). The module requires
# k8s.io/kubernetes, whose staging modules only its own go.mod's `replace` block pins: the wrapper
# copies those lines (a dependency's replaces are ignored), as build_kubernetes does. The
# gang-backend tests (make test-gang-backends) and the churn measurement run it; node only.
build_scheduler_plugins() {
  local root="$CACHE_ROOT/scheduler-plugins-$SCHEDULER_PLUGINS_VERSION" module_dir_ replaces kube_version
  local module=sigs.k8s.io/scheduler-plugins wrapper
  if [[ -x "$root/bin/kube-scheduler" && -s "$root/crds/scheduling.x-k8s.io_podgroups.yaml" ]]; then
    log "scheduler-plugins $SCHEDULER_PLUGINS_VERSION present: $root"
    return
  fi
  require_go
  export GONOSUMDB="${GONOSUMDB:+$GONOSUMDB,}$module"
  module_dir_="$(module_dir "$module" "$SCHEDULER_PLUGINS_VERSION")"
  replaces="$(sed -n 's#^[[:space:]]*\(k8s\.io/[^ ]*\) => \(k8s\.io/[^ ]* v[^ ]*\)$#\t\1 => \2#p; s#^replace \(k8s\.io/[^ ]*\) => \(k8s\.io/[^ ]* v[^ ]*\)$#\t\1 => \2#p' \
              "$module_dir_/go.mod")"
  [[ -n "$replaces" ]] || die "found no k8s.io replaces in $module_dir_/go.mod"
  wrapper="$BUILD_ROOT/scheduler-plugins-$SCHEDULER_PLUGINS_VERSION"
  write_wrapper "$wrapper" "$(sed -n 's/^go //p' "$module_dir_/go.mod")" \
    "$(printf '\t%s %s\n' "$module" "$SCHEDULER_PLUGINS_VERSION")" "$replaces"
  # The version stamp is the Kubernetes release it is built from: the scheduler derives its
  # emulation version from it (scheduler-plugins' own tag there makes it refuse to start).
  kube_version="$(sed -n 's#^[[:space:]]*k8s\.io/kubernetes => k8s\.io/kubernetes \(v[^ ]*\)$#\1#p' "$module_dir_/go.mod")"
  [[ -n "$kube_version" ]] || die "found no k8s.io/kubernetes replace in $module_dir_/go.mod"
  mkdir -p "$root/bin" "$root/crds"
  BIN_DIR="$root/bin" build_binary kube-scheduler "$wrapper" "$module/cmd/scheduler" \
    "-X k8s.io/component-base/version.gitVersion=$kube_version"
  cp "$module_dir_/manifests/coscheduling/crd.yaml" "$root/crds/scheduling.x-k8s.io_podgroups.yaml"
  chmod u+w "$root"/crds/*.yaml  # the module cache is read-only
  log "scheduler-plugins $SCHEDULER_PLUGINS_VERSION: $root"
}

# KWOK's controller (`kwok`, not the `kwokctl` cluster manager), from its Go module into
# $CACHE_ROOT/kwok-<version>/bin/: benchmarks/fleet runs it against its own control plane to
# simulate thousands of GPU nodes whose pods the real kube-scheduler binds. Node only (the
# benchmarks' full bootstrap), like the registry. The version stamp is the one its Makefile sets.
build_kwok() {
  local root="$CACHE_ROOT/kwok-$KWOK_VERSION"
  if [[ -x "$root/bin/kwok" ]]; then
    log "kwok $KWOK_VERSION present: $root"
    return
  fi
  build_from_module "$root" kwok sigs.k8s.io/kwok "$KWOK_VERSION" sigs.k8s.io/kwok/cmd/kwok \
    "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
}

# containerd's Makefile leaves btrfs out of static builds (it needs cgo) and
# stamps the version like this.
build_containerd() {
  local wrapper="$BUILD_ROOT/containerd-$CONTAINERD_VERSION" module_root name
  module_root="$(module_dir github.com/containerd/containerd/v2 "$CONTAINERD_VERSION")"
  write_wrapper "$wrapper" "$(sed -n 's/^go //p' "$module_root/go.mod")" \
    "$(printf '\tgithub.com/containerd/containerd/v2 %s\n' "$CONTAINERD_VERSION")" ""
  for name in "${CONTAINERD_BINARIES[@]}"; do
    have_binary "$name" && continue
    BUILD_TAGS=no_btrfs build_binary "$name" "$wrapper" "github.com/containerd/containerd/v2/cmd/$name" \
      "-X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION \
       -X github.com/containerd/containerd/v2/version.Revision=$CONTAINERD_VERSION"
  done
}

build_coredns() {
  local wrapper="$BUILD_ROOT/coredns-$COREDNS_VERSION" module_root
  module_root="$(module_dir github.com/coredns/coredns "$COREDNS_VERSION")"
  write_wrapper "$wrapper" "$(sed -n 's/^go //p' "$module_root/go.mod")" \
    "$(printf '\tgithub.com/coredns/coredns %s\n' "$COREDNS_VERSION")" ""
  build_binary coredns "$wrapper" github.com/coredns/coredns ""
}

install_node_packages() {
  local sudo="" missing=() package
  [[ "$(id -u)" == 0 ]] || sudo="sudo"
  for package in "${NODE_DEBIAN_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
  done
  ((${#missing[@]})) || { log "node packages present: ${NODE_DEBIAN_PACKAGES[*]}"; return; }
  log "installing Debian's ${missing[*]} (apt-get) ..."
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# --- prometheus ---------------------------------------------------------------

install_prometheus() {
  local sudo=""
  [[ "$(id -u)" == 0 ]] || sudo="sudo"
  if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
    log "installing Debian's prometheus package (apt-get) ..."
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends prometheus
  fi
  quiet_prometheus_service "$sudo"
  log "prometheus: $(prometheus --version 2>&1 | head -n1)"
}

# The tests start their own Prometheus on loopback; the distribution's service
# must be neither running nor enabled. Only the packaged service is touched
# (systemd unit, or the init script's pidfile): other prometheus processes,
# e.g. a test's, are left alone.
quiet_prometheus_service() {
  local sudo="$1"
  if command -v systemctl >/dev/null && [[ -d /run/systemd/system ]]; then
    if systemctl is-enabled --quiet prometheus 2>/dev/null || systemctl is-active --quiet prometheus 2>/dev/null; then
      log "stopping and disabling the packaged prometheus service"
      $sudo systemctl disable --now prometheus >/dev/null 2>&1 || true
    fi
  elif [[ -x /etc/init.d/prometheus ]]; then
    if [[ -f /run/prometheus/prometheus.pid ]]; then
      log "stopping the packaged prometheus service"
      $sudo /etc/init.d/prometheus stop >/dev/null 2>&1 || true
    fi
    if compgen -G '/etc/rc[2-5].d/S*prometheus' >/dev/null && command -v update-rc.d >/dev/null; then
      $sudo update-rc.d prometheus disable >/dev/null 2>&1 || true
    fi
  fi
}

# --- CRDs of the Prometheus Operator -------------------------------------------

fetch_monitoring_crds() {
  local name missing=0 module_root
  for name in "${MONITORING_CRDS[@]}"; do
    [[ -s "$MONITORING_CRD_DIR/monitoring.coreos.com_$name.yaml" ]] || missing=1
  done
  ((missing)) || { log "Prometheus Operator CRDs present: $MONITORING_CRD_DIR"; return; }
  require_go
  module_root="$(module_dir github.com/prometheus-operator/prometheus-operator "$PROMETHEUS_OPERATOR_VERSION")"
  mkdir -p "$MONITORING_CRD_DIR"
  for name in "${MONITORING_CRDS[@]}"; do
    cp "$module_root/example/prometheus-operator-crd/monitoring.coreos.com_$name.yaml" "$MONITORING_CRD_DIR/"
  done
  chmod u+w "$MONITORING_CRD_DIR"/*.yaml  # the module cache is read-only
  log "Prometheus Operator $PROMETHEUS_OPERATOR_VERSION CRDs: $MONITORING_CRD_DIR"
}

# NVIDIA's ComputeDomain CRD from its DRA driver's Go module (downloaded, not built). A module
# proxy that refuses the module is logged: the CRD test names this script when the file is absent.
fetch_nvidia_crds() {
  [[ -s "$NVIDIA_CRD_DIR/$NVIDIA_CRD_FILE" ]] && { log "NVIDIA ComputeDomain CRD present: $NVIDIA_CRD_DIR"; return; }
  require_go
  local json module_root found
  if ! json="$(go mod download -json "github.com/NVIDIA/k8s-dra-driver-gpu@$NVIDIA_DRA_DRIVER_VERSION" 2>&1)" \
      || ! grep -q '"Dir"' <<<"$json"; then
    log "WARNING: github.com/NVIDIA/k8s-dra-driver-gpu@$NVIDIA_DRA_DRIVER_VERSION is not served by $(go env GOPROXY); the ComputeDomain CRD test (make test-nvidia-crd) fails until it is: $(tr -d '\n' <<<"$json" | head -c 300)"
    return
  fi
  module_root="$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$json")"
  found="$(find "$module_root/deployments/helm" -name "$NVIDIA_CRD_FILE" | head -n 1)"
  [[ -n "$found" ]] || die "no $NVIDIA_CRD_FILE under $module_root/deployments/helm"
  mkdir -p "$NVIDIA_CRD_DIR"
  cp "$found" "$NVIDIA_CRD_DIR/"
  chmod u+w "$NVIDIA_CRD_DIR/$NVIDIA_CRD_FILE"  # the module cache is read-only
  log "NVIDIA DRA driver $NVIDIA_DRA_DRIVER_VERSION ComputeDomain CRD: $NVIDIA_CRD_DIR"
}

# --- main -----------------------------------------------------------------------

main() {
  mkdir -p "$BIN_DIR"
  # The versions file remembers the etcd version derived from the Kubernetes
  # module, so a warm run needs neither Go nor the network.
  if [[ -f "$BIN_DIR/versions" ]]; then
    ETCD_VERSION="$(sed -n 's/^etcd=//p' "$BIN_DIR/versions")"
  fi

  local missing=() name wanted=("${KUBE_BINARIES[@]}" etcd helm)
  ((WITH_NODE)) && wanted+=("${NODE_KUBE_BINARIES[@]}" "${CONTAINERD_BINARIES[@]}" coredns)
  for name in "${wanted[@]}"; do
    have_binary "$name" || missing+=("$name")
  done

  if ((${#missing[@]})); then
    log "to build: ${missing[*]}"
    require_go
    export GOTOOLCHAIN=local
    local kube_dir go_need
    kube_dir="$(module_dir k8s.io/kubernetes "$K8S_VERSION")"
    go_need="$(sed -n 's/^go //p' "$kube_dir/go.mod")"
    require_go_at_least "$go_need"
    log "using $(go version | cut -d' ' -f3-) for Kubernetes $K8S_VERSION (needs go >= $go_need)"
    ETCD_VERSION="$(grep -A1 'name: "etcd"' "$kube_dir/build/dependencies.yaml" \
                    | sed -n 's/^[[:space:]]*version: //p')"
    [[ -n "$ETCD_VERSION" ]] || die "could not read the etcd version from $kube_dir/build/dependencies.yaml"
    log "Kubernetes $K8S_VERSION recommends etcd $ETCD_VERSION"
    ((WITH_NODE)) || NODE_KUBE_BINARIES=()
    build_kubernetes "$kube_dir"
    have_binary etcd || build_etcd
    have_binary helm || build_helm
    if ((WITH_NODE)); then
      build_containerd
      have_binary coredns || build_coredns
    fi
  fi

  printf 'kubernetes=%s\netcd=%s\nhelm=%s\ncontainerd=%s\ncoredns=%s\n' "$K8S_VERSION" "$ETCD_VERSION" \
    "$HELM_VERSION" "$CONTAINERD_VERSION" "$COREDNS_VERSION" >"$BIN_DIR/versions"
  for name in "${wanted[@]}"; do
    have_binary "$name" || die "$name in $BIN_DIR does not report version $(wanted_version "$name")"
  done
  log "all binaries present: ${wanted[*]}"
  fetch_monitoring_crds
  build_kueue
  build_versitygw

  ((WITH_NODE)) && build_kube_router
  ((WITH_NODE)) && build_registry
  ((WITH_NODE)) && build_dra_driver
  ((WITH_NODE)) && fetch_nvidia_crds
  ((WITH_NODE)) && build_scheduler_plugins
  ((WITH_NODE)) && build_kwok
  ((WITH_NODE)) && install_node_packages
  ((WITH_PROMETHEUS)) && install_prometheus
  log "done in $((SECONDS - START_SECONDS))s"
  echo "$BIN_DIR"
}

main
