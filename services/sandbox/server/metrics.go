package server

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"

	"agentplane.dev/services/sandbox/internal/control/reconciler"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// admissions counts capacity admissions of cold workspaces by result.
var admissionResults = []string{"warm", "admitted", "admitted_after_cleanup", "rejected", "enospc", "unmeasurable", "error"}

func newAdmissions() *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "agentplane_sandbox_capacity_admissions_total",
		Help: "Workspace capacity admissions, by result (warm: no check; admitted; admitted_after_cleanup; rejected: CAPACITY_REJECTED; enospc; unmeasurable; error).",
	}, []string{"result"})
}

func admissionResult(warm bool, cleaned int, err error) string {
	switch {
	case warm:
		return "warm"
	case err == nil && cleaned > 0:
		return "admitted_after_cleanup"
	case err == nil:
		return "admitted"
	case errors.Is(err, provider.ErrCapacityRejected):
		return "rejected"
	case errors.Is(err, provider.ErrDiskQuota):
		return "disk_quota"
	case errors.Is(err, provider.ErrENOSPC):
		return "enospc"
	case errors.Is(err, provider.ErrCapacityUnmeasurable):
		return "unmeasurable"
	}
	return "error"
}

// registerObservability registers the reconciler's and the admission
// metrics once on the service's registry (every result label shows from the
// start, at zero, so rate() and alerts see the series before the first event).
func registerObservability(reg *prometheus.Registry, rec *reconciler.Metrics, admissions *prometheus.CounterVec) error {
	if err := rec.Register(reg); err != nil {
		return err
	}
	for _, r := range admissionResults {
		admissions.WithLabelValues(r)
	}
	return reg.Register(admissions)
}
