package service

import (
	"context"
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"agentplane.dev/services/session/internal/session"
)

// Metrics are the session service's Prometheus metrics. Labels are states,
// reasons and results: bounded sets, never a session or message id.
type Metrics struct {
	sessions    *prometheus.CounterVec
	messages    *prometheus.CounterVec
	backstops   *prometheus.CounterVec
	deletions   *prometheus.CounterVec
	deleteTime  prometheus.Histogram
	subscribers prometheus.Gauge
}

// NewMetrics builds the metrics; Register adds them to a registry.
func NewMetrics() *Metrics {
	return &Metrics{
		sessions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentplane_session_session_transitions_total",
			Help: "Session state changes committed by this replica, by from and to state (new, active, stopped, deleting, deleted).",
		}, []string{"from", "to"}),
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentplane_session_message_transitions_total",
			Help: "Message state changes committed by this replica, by from and to state (new, queued, accepted, completed, failed, cancelled).",
		}, []string{"from", "to"}),
		backstops: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentplane_session_backstop_failures_total",
			Help: "Messages failed by a backstop (queued or accepted too long), by failure reason.",
		}, []string{"reason"}),
		deletions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentplane_session_deletion_attempts_total",
			Help: "Session deletion attempts, by result (deleted; pending: a step is not done yet and is retried; error).",
		}, []string{"result"}),
		deleteTime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "agentplane_session_deletion_duration_seconds",
			Help:    "Seconds from a session's deletion intent to its wipe.",
			Buckets: []float64{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600},
		}),
		subscribers: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "agentplane_session_watch_subscribers",
			Help: "WatchSession streams open on this replica.",
		}),
	}
}

// StateCounter reads how many sessions are in each state (store.StateCounts).
type StateCounter func(ctx context.Context) (map[session.State]int64, error)

// stateGauge is agentplane_session_sessions{state}: the deployment-wide
// counts the store keeps beside each state change, read at scrape time.
type stateGauge struct {
	desc  *prometheus.Desc
	count StateCounter
}

func (g stateGauge) Describe(ch chan<- *prometheus.Desc) { ch <- g.desc }

// Collect reports nothing when the counts cannot be read: the rest of the
// page (agentplane_ready among it) still answers.
func (g stateGauge) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	counts, err := g.count(ctx)
	if err != nil {
		return
	}
	for st, n := range counts {
		ch <- prometheus.MustNewConstMetric(g.desc, prometheus.GaugeValue, float64(n), string(st))
	}
}

// Register adds the metrics to reg; with states, also the sessions-by-state
// gauge.
func (m *Metrics) Register(reg prometheus.Registerer, states StateCounter) error {
	cs := []prometheus.Collector{m.sessions, m.messages, m.backstops, m.deletions, m.deleteTime, m.subscribers}
	if states != nil {
		cs = append(cs, stateGauge{count: states, desc: prometheus.NewDesc("agentplane_session_sessions",
			"Sessions of the deployment by state (active, stopped; deleting: a deletion intent not yet wiped), from counts kept in Redis with each state change.",
			[]string{"state"}, nil)})
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	for _, r := range []string{"deleted", "pending", "error"} {
		m.deletions.WithLabelValues(r)
	}
	return nil
}

// states is what a transition changed: the session's state and each
// message's, read before and after the change function.
type states struct {
	session  session.State
	messages map[string]session.MessageState
}

func statesOf(a *session.Aggregate) states {
	s := states{session: a.Session.State, messages: map[string]session.MessageState{}}
	for _, m := range a.Active {
		s.messages[m.ID] = m.State
	}
	// Lookup may be a copy of an Active message that the change did not touch: Active wins.
	if a.Lookup != nil {
		if _, active := s.messages[a.Lookup.ID]; !active {
			s.messages[a.Lookup.ID] = a.Lookup.State
		}
	}
	return s
}

func orNew[T ~string](s T) string {
	if s == "" {
		return "new"
	}
	return string(s)
}

// committed counts the changes between before and after (a committed update).
func (m *Metrics) committed(before, after states) {
	if m == nil {
		return
	}
	if before.session != after.session {
		m.sessions.WithLabelValues(orNew(before.session), orNew(after.session)).Inc()
	}
	for id, to := range after.messages {
		if from := before.messages[id]; from != to {
			m.messages.WithLabelValues(orNew(from), string(to)).Inc()
		}
	}
}

func (m *Metrics) created() {
	if m != nil {
		m.sessions.WithLabelValues("new", string(session.StateActive)).Inc()
	}
}

// backstopped counts the messages a backstop failed in a committed sweep.
func (m *Metrics) backstopped(before states, a *session.Aggregate) {
	if m == nil {
		return
	}
	for _, msg := range append(a.Active, a.Lookup) {
		if msg != nil && msg.State == session.MessageFailed && before.messages[msg.ID] != session.MessageFailed {
			m.backstops.WithLabelValues(msg.FailureReason).Inc()
		}
	}
}

func (m *Metrics) deletion(result string, intentAt, now time.Time) {
	if m == nil {
		return
	}
	m.deletions.WithLabelValues(result).Inc()
	if result == "deleted" && !intentAt.IsZero() {
		m.deleteTime.Observe(now.Sub(intentAt).Seconds())
	}
}

func (m *Metrics) watching(delta float64) {
	if m != nil {
		m.subscribers.Add(delta)
	}
}

// deletionFailed counts an attempt that did not finish: pending (a step
// postponed, retried later) or error.
func (m *Metrics) deletionFailed(err error) {
	if m == nil || err == nil {
		return
	}
	var pending *session.DeletionPendingError
	if errors.As(err, &pending) {
		m.deletions.WithLabelValues("pending").Inc()
		return
	}
	m.deletions.WithLabelValues("error").Inc()
}
