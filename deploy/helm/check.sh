#!/usr/bin/env bash
# Chart checks, called by `make helm-check` (and so by `make test`):
#   - renders deploy/helm/agentplane with the Helm SDK for every ci/*-values.yaml, strictly
#     decodes every manifest into its Kubernetes / ServiceMonitor type and asserts the chart's
#     invariants (probes, PDBs, Service selectors, ServiceMonitor ports, privileges, grace
#     period, NetworkPolicies, secret references);
#   - checks that schema-breaking values fail to render with the schema's message;
#   - runs the Helm SDK's strict lint (warnings fail) for every ci/ values file;
#   - on the test cluster (internal/kubecluster, binaries from deploy/cluster/build.sh, which
#     `make helm-check` runs first; required here: a missing cluster fails):
#     install --wait, upgrade, uninstall of every ci/ values file, PodSecurity per pod, an
#     install by a namespace admin;
#   - the sandbox pod's seccomp and AppArmor profiles (deploy/profiles).
# The Go module deploy/helm is not in go.work, so it runs with GOWORK=off.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
export GOWORK=off AGENTPLANE_TEST_CLUSTER=required
go vet ./...
go test -count=1 -timeout 30m "$@" ./...
