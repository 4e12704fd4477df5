// Package helm holds the checks of the agentplane Helm chart (deploy/helm/agentplane).
//
// The tests render the chart with the Helm SDK for every values file in agentplane/ci,
// strictly decode every manifest into its Kubernetes or Prometheus Operator type (unknown
// fields are errors), assert the chart's invariants, check that schema-breaking values fail
// with the schema's message, and run the SDK's strict lint. Run them with
//
//	cd deploy/helm && GOWORK=off go test ./...
//
// or `bash deploy/helm/check.sh` (what `make helm-check` calls). This module is not in go.work
// so that the Kubernetes and Helm dependencies stay out of the services.
package helm
