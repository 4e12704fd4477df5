package grants

import (
	"context"
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"agentplane.dev/services/credential/internal/scope"
)

// Metrics are the grant service's Prometheus metrics: resolutions by
// result, rotations, revoked handles. Labels are results only.
type Metrics struct {
	resolutions *prometheus.CounterVec
	rotations   *prometheus.CounterVec
	revocations prometheus.Counter
}

// resolveResults are the result labels of resolutions.
var resolveResults = []string{"ok", "malformed", "unknown_handle", "no_live_member", "sandbox_mismatch", "unavailable"}

// NewMetrics builds the metrics and registers them on reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		resolutions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentplane_credential_resolutions_total",
			Help: "Handle resolutions (proxy requests and ResolveHandle), by result (ok, malformed, unknown_handle, no_live_member, sandbox_mismatch, unavailable).",
		}, []string{"result"}),
		rotations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentplane_credential_rotations_total",
			Help: "Canonical handle rotations, by result (ok, error).",
		}, []string{"result"}),
		revocations: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "agentplane_credential_revoked_handles_total",
			Help: "Handles revoked by scope retirement (a retired scope's accepted handles stop resolving).",
		}),
	}
	for _, r := range resolveResults {
		m.resolutions.WithLabelValues(r)
	}
	m.rotations.WithLabelValues("ok")
	m.rotations.WithLabelValues("error")
	for _, c := range []prometheus.Collector{m.resolutions, m.rotations, m.revocations} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// Observe makes s count into m. Call it before serving.
func (s *Service) Observe(m *Metrics) { s.obs = m }

func resolveResult(err error) string {
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, ErrMalformedHandle):
		return "malformed"
	case errors.Is(err, scope.ErrUnknownHandle):
		return "unknown_handle"
	case errors.Is(err, scope.ErrNoLiveMember):
		return "no_live_member"
	case errors.Is(err, scope.ErrSandboxMismatch):
		return "sandbox_mismatch"
	}
	return "unavailable"
}

// Resolve is resolve, counted.
func (s *Service) Resolve(ctx context.Context, raw, sandboxID string) (*Resolved, error) {
	r, err := s.resolve(ctx, raw, sandboxID)
	if s.obs != nil {
		s.obs.resolutions.WithLabelValues(resolveResult(err)).Inc()
	}
	return r, err
}

// Rotate is rotate, counted.
func (s *Service) Rotate(ctx context.Context, sc scope.Scope, token uint64) (string, Grant, time.Time, error) {
	raw, g, until, err := s.rotate(ctx, sc, token)
	if s.obs != nil {
		res := "ok"
		if err != nil {
			res = "error"
		}
		s.obs.rotations.WithLabelValues(res).Inc()
	}
	return raw, g, until, err
}

// Retire is retire, counted: n handles revoked.
func (s *Service) Retire(ctx context.Context, sc scope.Scope, lastMember bool, token uint64) (int, error) {
	n, err := s.retire(ctx, sc, lastMember, token)
	if s.obs != nil && err == nil {
		s.obs.revocations.Add(float64(n))
	}
	return n, err
}
