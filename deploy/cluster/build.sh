#!/usr/bin/env bash
# Builds the test cluster's binaries into a cache outside the repository that later runs reuse:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/agentplane/cluster/<kubernetes version>/bin/
#     kube-apiserver kube-controller-manager kube-scheduler  (k8s.io/kubernetes)
#     etcd   (go.etcd.io/etcd/server/v3, the version k8s.io/kubernetes itself requires)
#     kwok   (sigs.k8s.io/kwok/cmd/kwok; its stage definitions in ../stage/)
#     helm   (helm.sh/helm/v3/cmd/helm, for `helm template` as documented and by hand)
# The pins are this directory's go.mod (its `tool` lines): one module graph for all six, which
# also requires agentplane.dev/deploy/helm, so every package they share with each other and with
# the chart tests (k8s.io/api, client-go, apimachinery, gRPC, protobuf, ...) is compiled once,
# by one `go build`, and is then in the build cache for the chart tests as well.
# Rebuilt only when go.mod or go.sum changes (the stamp). Prints the cache directory last.
# Cold/warm figures and their commands: docs/development.md "The test cluster".
# The test harness (deploy/helm/internal/kubecluster) reads the directory from
# AGENTPLANE_CLUSTER_DIR or this script's default (--print-dir).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
export GOWORK=off GOFLAGS=-mod=readonly GOTOOLCHAIN=local

K8S_VERSION=v1.37.2 # must match go.mod's k8s.io/kubernetes (checked below)
DIR="${AGENTPLANE_CLUSTER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/agentplane/cluster/$K8S_VERSION}"
if [ "${1:-}" = "--print-dir" ]; then echo "$DIR"; exit 0; fi
mkdir -p "$DIR/bin"

# Another run (CI starts one in the background) may be building: wait for it, then reuse.
exec 9>"$DIR/.lock"
flock 9

stamp="$(cat go.mod go.sum | sha256sum | cut -c1-16)"
if [ "$(cat "$DIR/bin/.stamp" 2>/dev/null)" = "$stamp" ]; then echo "$DIR"; exit 0; fi

have="$(go list -m -f '{{.Version}}' k8s.io/kubernetes)"
if [ "$have" != "$K8S_VERSION" ]; then
  echo "build.sh: K8S_VERSION=$K8S_VERSION but go.mod has k8s.io/kubernetes $have" >&2; exit 1
fi
echo "building kube-apiserver, kube-controller-manager, kube-scheduler $K8S_VERSION, etcd, kwok, helm" >&2
rm -f "$DIR/bin/.stamp"
# Without the stamps the server reports v0.0.0 and Helm refuses the chart's kubeVersion.
pkg=k8s.io/component-base/version
minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
ldflags="-s -w -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z -X $pkg.gitCommit=0000000000000000000000000000000000000000"
# Low priority: in CI it runs in the background next to lint and the tests. Default flags
# otherwise (no -race, no -trimpath, no -gcflags): the compiled packages' cache keys are then
# the chart tests' own. One invocation: shared packages compile once, -p is GOMAXPROCS.
nice -n "${AGENTPLANE_CLUSTER_NICE:-15}" go build -ldflags "$ldflags" -o "$DIR/bin/" \
  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler go.etcd.io/etcd/server/v3 sigs.k8s.io/kwok/cmd/kwok \
  helm.sh/helm/v3/cmd/helm
mv "$DIR/bin/server" "$DIR/bin/etcd" # go names go.etcd.io/etcd/server/v3's binary "server"
# kwok moves nodes and pods through these stages (Ready nodes, Running pods, deletion).
src="$(go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
rm -rf "$DIR/stage"; cp -r "$src/kustomize/stage" "$DIR/stage"; chmod -R u+w "$DIR/stage"
echo "$stamp" >"$DIR/bin/.stamp"
echo "$DIR"
