package reconciler

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"agentplane.dev/services/sandbox/internal/control/lease"
	"agentplane.dev/services/sandbox/internal/control/leasestore"
	"agentplane.dev/services/sandbox/internal/node/provider"
)

// Metrics are the reconciler's Prometheus metrics. Labels are lease states,
// stop results and stop reasons: bounded sets, never a sandbox id.
type Metrics struct {
	leases       *prometheus.GaugeVec
	exhausted    prometheus.Gauge
	leakedKnown  prometheus.Gauge
	leakedFound  *prometheus.CounterVec
	leakStopped  prometheus.Counter
	stopAttempts *prometheus.CounterVec
	cleanup      prometheus.Histogram

	mu        sync.Mutex
	requested map[string]time.Time // sandbox/key → when this process saw the stop requested
}

// NewMetrics builds the reconciler's metrics; Register adds them to a registry.
func NewMetrics() *Metrics {
	return &Metrics{
		leases: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "agentplane_sandbox_wrapper_leases",
			Help: "Wrapper leases of the sandboxes this replica owns, by lease state (none, owns_wrapper, stop_needed, stopping), as of the last reconciler tick.",
		}, []string{"state"}),
		exhausted: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "agentplane_sandbox_exhausted_leases",
			Help: "Wrapper leases whose stop retries are exhausted (cleanup gave up the fast schedule; an operator must look), as of the last tick.",
		}),
		leakedKnown: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "agentplane_sandbox_leaked_wrappers",
			Help: "Leaked wrappers (no lease owns them, or a mismatch) this replica knows of and has not yet verified gone, as of the last tick.",
		}),
		leakedFound: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentplane_sandbox_leaked_wrappers_found_total",
			Help: "Leaked wrappers found by the leak sweep, by reason (leaked, discovery_mismatch).",
		}, []string{"reason"}),
		leakStopped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "agentplane_sandbox_leaked_wrappers_stopped_total",
			Help: "Leaked wrappers stopped, their absence verified.",
		}),
		stopAttempts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentplane_sandbox_stop_attempts_total",
			Help: "Wrapper stop attempts, by result (absent, still_present, inspection_failed).",
		}, []string{"result"}),
		cleanup: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "agentplane_sandbox_cleanup_duration_seconds",
			Help:    "Seconds from a wrapper stop being requested to its absence being verified (measured by the replica that saw both).",
			Buckets: []float64{0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600},
		}),
		requested: map[string]time.Time{},
	}
}

// Register adds the metrics to reg.
func (m *Metrics) Register(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.leases, m.exhausted, m.leakedKnown, m.leakedFound, m.leakStopped, m.stopAttempts, m.cleanup} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

func isLeak(reason string) bool { return reason == ReasonLeaked || reason == ReasonMismatch }

// transition observes one persisted lease change of sandbox/key.
func (m *Metrics) transition(sandboxID, key string, prev, next lease.Lease, now time.Time) {
	if m == nil {
		return
	}
	id := sandboxID + "/" + key
	stopping := func(s lease.State) bool { return s == lease.StopNeeded || s == lease.Stopping }
	m.mu.Lock()
	defer m.mu.Unlock()
	switch {
	case !stopping(prev.State) && stopping(next.State):
		m.requested[id] = now
	case stopping(prev.State) && !stopping(next.State):
		if at, ok := m.requested[id]; ok {
			m.cleanup.Observe(now.Sub(at).Seconds())
			delete(m.requested, id)
		}
		if next.State == lease.None && isLeak(prev.StopReason) {
			m.leakStopped.Inc()
		}
	}
}

func (m *Metrics) leakFound(reason string) {
	if m != nil {
		m.leakedFound.WithLabelValues(reason).Inc()
	}
}

func (m *Metrics) stopAttempt(k provider.StopKind) {
	if m != nil {
		m.stopAttempts.WithLabelValues(StopResultLabel(k)).Inc()
	}
}

// leaseCensus counts the leases one tick read.
type leaseCensus struct {
	byState           map[lease.State]int
	exhausted, leaked int
}

func (c *leaseCensus) add(all map[string]leasestore.Entry) {
	if c.byState == nil {
		c.byState = map[lease.State]int{}
	}
	for _, e := range all {
		c.byState[e.Lease.State]++
		if e.Lease.Exhausted {
			c.exhausted++
		}
		if (e.Lease.State == lease.StopNeeded || e.Lease.State == lease.Stopping) && isLeak(e.Lease.StopReason) {
			c.leaked++
		}
	}
}

func (m *Metrics) census(c leaseCensus) {
	if m == nil {
		return
	}
	for _, s := range []lease.State{lease.None, lease.OwnsWrapper, lease.StopNeeded, lease.Stopping} {
		m.leases.WithLabelValues(string(s)).Set(float64(c.byState[s]))
	}
	m.exhausted.Set(float64(c.exhausted))
	m.leakedKnown.Set(float64(c.leaked))
}
