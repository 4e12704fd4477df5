#!/usr/bin/env bash
# Builds the test cluster's binaries from the Go module proxy, pinned below, into a cache outside
# the repository that later runs reuse:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/agentplane/cluster/<kubernetes version>/bin/
#     kube-apiserver kube-controller-manager kube-scheduler  (k8s.io/kubernetes)
#     etcd   (a small main calling go.etcd.io/etcd/server/v3/etcdmain.Main)
#     kwok   (sigs.k8s.io/kwok/cmd/kwok; its stage definitions in ../stage/)
#     helm   (helm.sh/helm/v3/cmd/helm, for running the chart by hand)
# Each binary is rebuilt only when its pin changes. Prints the cache directory on its last line.
# Cold: 15-25 minutes on 2 cores and ~7 GB of module cache and build cache; warm: seconds.
# The test harness (deploy/helm/internal/kubecluster) reads the directory from
# AGENTPLANE_CLUSTER_DIR or this script's default.
set -euo pipefail

K8S_VERSION=v1.37.2      # k8s.io/kubernetes; the published k8s.io/* staging modules are v0.37.2
ETCD_VERSION=v3.6.16     # go.etcd.io/etcd/server/v3 (Debian's etcd 3.4 lacks the watch feature kwok needs)
KWOK_VERSION=v0.8.0      # sigs.k8s.io/kwok
HELM_VERSION=v3.22.0     # helm.sh/helm/v3, the same as deploy/helm/go.mod

DIR="${AGENTPLANE_CLUSTER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/agentplane/cluster/$K8S_VERSION}"
if [ "${1:-}" = "--print-dir" ]; then echo "$DIR"; exit 0; fi
mkdir -p "$DIR/bin" "$DIR/src"
export GOWORK=off GOFLAGS=-mod=mod GOTOOLCHAIN=local
# Low priority: the build shares the machine with the test suites. No -trimpath: the build
# cache entries of the k8s.io modules and the standard library are then shared with the
# chart tests' and every other build on the machine.
NICE="nice -n ${AGENTPLANE_CLUSTER_NICE:-15}"

exec 9>"$DIR/.lock"
flock 9

# fresh NAME VERSION: true when bin/NAME was built from VERSION.
fresh() { [ -x "$DIR/bin/$1" ] && [ "$(cat "$DIR/bin/$1.version" 2>/dev/null)" = "$2" ]; }
stamp() { echo "$2" >"$DIR/bin/$1.version"; }
modDir() { go mod download -json "$1" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p'; }

if ! fresh kube-apiserver "$K8S_VERSION"; then
  echo "building kube-apiserver, kube-controller-manager, kube-scheduler $K8S_VERSION" >&2
  src="$(modDir "k8s.io/kubernetes@$K8S_VERSION")"
  work="$DIR/src/kubernetes"
  rm -rf "$work"; cp -r "$src" "$work"; chmod -R u+w "$work"
  # The module zip holds no staging/ (each is its own module) and its vendor/ and go.work point
  # at it: build against the published k8s.io/* modules of the same minor instead.
  rm -rf "$work/vendor" "$work/go.work" "$work/go.work.sum"
  minor="${K8S_VERSION#v1.}"
  staging="v0.$minor"
  sed -i -E "s#=> \./staging/src/(k8s\.io/[a-z0-9-]+)\$#=> \1 $staging#" "$work/go.mod"
  major=1; kminor="${minor%%.*}"
  pkg=k8s.io/component-base/version
  # Without the stamps the server reports v0.0.0 and Helm refuses the chart's kubeVersion.
  ldflags="-s -w -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$kminor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z -X $pkg.gitCommit=0000000000000000000000000000000000000000"
  (cd "$work" && $NICE go build -ldflags "$ldflags" -o "$DIR/bin/" \
    ./cmd/kube-apiserver ./cmd/kube-controller-manager ./cmd/kube-scheduler)
  for b in kube-apiserver kube-controller-manager kube-scheduler; do stamp "$b" "$K8S_VERSION"; done
  rm -rf "$work"
fi

if ! fresh etcd "$ETCD_VERSION"; then
  echo "building etcd $ETCD_VERSION" >&2
  work="$DIR/src/etcd"
  rm -rf "$work"; mkdir -p "$work"
  cat >"$work/main.go" <<'GO'
// Command etcd is the etcd server, built from its module for the test cluster.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
  (cd "$work" && go mod init agentplane.dev/testcluster/etcd >/dev/null 2>&1 \
    && go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >/dev/null && go mod tidy >/dev/null \
    && $NICE go build -ldflags "-s -w" -o "$DIR/bin/etcd" .)
  stamp etcd "$ETCD_VERSION"
  rm -rf "$work"
fi

if ! fresh kwok "$KWOK_VERSION"; then
  echo "building kwok $KWOK_VERSION" >&2
  GOBIN="$DIR/bin" $NICE go install -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  # kwok moves nodes and pods through these stages (Ready nodes, Running pods, deletion).
  src="$(modDir "sigs.k8s.io/kwok@$KWOK_VERSION")"
  rm -rf "$DIR/stage"; cp -r "$src/kustomize/stage" "$DIR/stage"; chmod -R u+w "$DIR/stage"
  stamp kwok "$KWOK_VERSION"
fi

if ! fresh helm "$HELM_VERSION"; then
  echo "building helm $HELM_VERSION" >&2
  GOBIN="$DIR/bin" $NICE go install -ldflags "-s -w" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  stamp helm "$HELM_VERSION"
fi

echo "$DIR"
