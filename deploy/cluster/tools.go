//go:build tools

// Package cluster builds the test cluster's binaries (build.sh) in one module graph with the
// chart tests: requiring agentplane.dev/deploy/helm puts its module versions into this graph,
// so the k8s.io, gRPC and protobuf packages both compile are compiled once and shared through
// the build cache (TestClusterModuleSharesVersions in deploy/helm checks that they match).
package cluster

import _ "agentplane.dev/deploy/helm"
