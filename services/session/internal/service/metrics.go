package service

import (
	"context"
	"errors"
	"sync"
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
	suspends    prometheus.Counter // idle suspends only
	suspended   prometheus.Counter // every route that became suspended
	resumes     *prometheus.CounterVec
	resumeTime  prometheus.Histogram
	tokens      *prometheus.CounterVec
	requests    *prometheus.CounterVec
	cost        *prometheus.CounterVec

	modelsMu sync.Mutex
	models   map[string]bool // model label values in use (at most maxModelLabels)
}

// maxModelLabels bounds the model label's values: a model name comes from
// the provider's responses; past this many, "other".
const maxModelLabels = 64

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
		suspends: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "agentplane_session_idle_suspends_total",
			Help: "Sessions whose runtime this replica suspended after suspend_after without a turn (SuspendSession calls are not counted).",
		}),
		suspended: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "agentplane_session_suspends_total",
			Help: "Session routes that became suspended in a change this replica committed (SuspendSession and the idle suspend alike).",
		}),
		resumes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentplane_session_resumes_total",
			Help: "Resumes of suspended routes that ended in a change this replica committed, by result (ready, failed).",
		}, []string{"result"}),
		resumeTime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "agentplane_session_resume_duration_seconds",
			Help:    "Seconds from a suspended session's resume (its message or ResumeSession) to its route ready.",
			Buckets: []float64{0.1, 0.25, 0.5, 1, 1.5, 2, 3, 5, 8, 13, 20, 30, 60, 120},
		}),
		tokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentplane_session_tokens_total",
			Help: "Provider tokens the credential proxy read from responses, by the session's agent profile (\"\": the default), model (the first 64 names; then \"other\") and kind (input, output, cached; cached is part of input).",
		}, []string{"profile", "model", "kind"}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentplane_session_provider_requests_total",
			Help: "Provider responses that reported token usage, by the session's agent profile and model (as agentplane_session_tokens_total).",
		}, []string{"profile", "model"}),
		cost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "agentplane_session_cost_usd_total",
			Help: "Cost in US dollars of the provider tokens the price table (SESSION_PRICE_TABLE) prices, by the session's agent profile and model (as agentplane_session_tokens_total).",
		}, []string{"profile", "model"}),
		models: map[string]bool{},
	}
}

// usage counts one provider response's tokens.
func (m *Metrics) usage(profile string, u session.Usage) {
	model := m.modelLabel(u.Model)
	m.tokens.WithLabelValues(profile, model, "input").Add(float64(u.Input))
	m.tokens.WithLabelValues(profile, model, "output").Add(float64(u.Output))
	m.tokens.WithLabelValues(profile, model, "cached").Add(float64(u.Cached))
	m.requests.WithLabelValues(profile, model).Add(float64(u.Requests))
	if u.CostUSD > 0 {
		m.cost.WithLabelValues(profile, model).Add(u.CostUSD)
	}
}

func (m *Metrics) modelLabel(model string) string {
	m.modelsMu.Lock()
	defer m.modelsMu.Unlock()
	if !m.models[model] {
		if len(m.models) >= maxModelLabels {
			return "other"
		}
		m.models[model] = true
	}
	return model
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
	cs := []prometheus.Collector{m.sessions, m.messages, m.backstops, m.deletions, m.deleteTime, m.subscribers, m.suspends,
		m.suspended, m.resumes, m.resumeTime, m.tokens, m.requests, m.cost}
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
	for _, r := range []string{"ready", "failed"} {
		m.resumes.WithLabelValues(r)
	}
	return nil
}

// states is what a transition changed: the session's state and each
// message's, read before and after the change function.
type states struct {
	session  session.State
	messages map[string]session.MessageState
	route    session.RouteState
	resumed  *session.ResumeEnd // after: a resume the change ended
}

func statesOf(a *session.Aggregate) states {
	s := states{session: a.Session.State, messages: map[string]session.MessageState{},
		route: a.Session.Route.State, resumed: a.Resumed()}
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
	if before.route != session.RouteSuspended && after.route == session.RouteSuspended {
		m.suspended.Inc()
	}
	if r := after.resumed; r != nil {
		if !r.Ready {
			m.resumes.WithLabelValues("failed").Inc()
			return
		}
		m.resumes.WithLabelValues("ready").Inc()
		m.resumeTime.Observe(r.Took.Seconds())
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

// suspendedIdle counts one idle runtime suspended by SuspendIdle.
func (m *Metrics) suspendedIdle() {
	if m != nil {
		m.suspends.Inc()
	}
}
