#!/usr/bin/env bash
# Chart checks, called by `make helm-check` (and so by `make test`):
#   - renders deploy/helm/agentplane with the Helm SDK for every ci/*-values.yaml, strictly
#     decodes every manifest into its Kubernetes / ServiceMonitor type and asserts the chart's
#     invariants (probes, PDBs, Service selectors, ServiceMonitor ports, privileges, grace
#     period, NetworkPolicies, secret references);
#   - checks that schema-breaking values fail to render with the schema's message;
#   - runs the Helm SDK's strict lint (warnings fail) for every ci/ values file;
#   - the sandbox pod's seccomp and AppArmor profiles (deploy/profiles).
# The tests on the test cluster (install/upgrade/uninstall, PodSecurity, namespace admin, helm
# template) are `make test-cluster`, which `make test` runs after this: it builds (or reuses)
# the cluster first, and a missing cluster fails them there.
# The Go module deploy/helm is not in go.work, so it runs with GOWORK=off.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
export GOWORK=off
go vet ./...
go test -count=1 -timeout 30m \
  -skip '^(TestChartOnCluster|TestChartByNamespaceAdmin|TestPodSecurityLevels|TestHelmTemplateAsDocumented)$' "$@" ./...
