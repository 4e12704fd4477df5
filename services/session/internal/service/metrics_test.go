package service

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/redistest"
	"agentplane.dev/pkg/testclock"
	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

// preparingSandbox suspends at once and answers Prepare with a route still
// preparing: the route's readiness comes by notice, as from the sandbox.
type preparingSandbox struct{ suspendingSandbox }

func (*preparingSandbox) Prepare(_ context.Context, sess *session.Session, _ bool) (session.RouteView, error) {
	return session.RouteView{State: session.RoutePreparing, SandboxID: sess.SandboxID}, nil
}

// Issue 35 item 5: suspends are counted once each, whatever asked for them;
// a resume is counted by how it ended, and the seconds from its message or
// ResumeSession to the ready route are observed (the test's clock moves 3 s
// meanwhile, so the histogram holds exactly that).
func TestSuspendAndResumeMetrics(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.Start(t).Client(t)
	c := testclock.New(time.Now())
	m := NewMetrics()
	reg := prometheus.NewRegistry()
	require.NoError(t, m.Register(reg, nil))
	backstops := session.Backstops{QueuedFor: time.Hour, AcceptedFor: time.Hour}
	s := New(Deps{Store: store.New(rdb, 1000, backstops.NextDeadline), Sandbox: &preparingSandbox{},
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Metrics: m},
		Config{Backstops: backstops, PeerTimeout: 5 * time.Second, Now: c.Now})
	t.Cleanup(s.Close)

	sess, err := s.Create(ctx, CreateInput{ID: "s1", UserID: "u1", OrgID: "o1", Directory: "/w", Class: session.CredentialStatic, Secret: "x"})
	require.NoError(t, err)
	notice := func(token uint64) session.Notice { return session.Notice{SandboxID: sess.SandboxID, FenceToken: token} }
	require.NoError(t, s.RouteReady(ctx, "s1", notice(1), "rs", "w1"))
	_, err = s.Suspend(ctx, "s1", false)
	require.NoError(t, err)
	_, err = s.Suspend(ctx, "s1", false)
	require.NoError(t, err)
	require.InDelta(t, 1, testutil.ToFloat64(m.suspended), 0, "a repeated suspend is one")

	// ResumeSession: the route prepares, 3 s pass, it is ready.
	resumed := make(chan error, 1)
	go func() { _, err := s.Resume(ctx, "s1", false); resumed <- err }()
	require.Eventually(t, func() bool {
		got, err := s.Get(ctx, "s1")
		require.NoError(t, err)
		return got.Route.State == session.RoutePreparing
	}, 20*time.Second, time.Millisecond)
	c.Add(3 * time.Second)
	require.NoError(t, s.RouteReady(ctx, "s1", notice(2), "rs", "w2"))
	require.NoError(t, <-resumed)
	require.InDelta(t, 1, testutil.ToFloat64(m.resumes.WithLabelValues("ready")), 0)
	count, sum := histogram(t, reg, "agentplane_session_resume_duration_seconds")
	require.Equal(t, uint64(1), count)
	require.InDelta(t, 3, sum, 0.001, "from ResumeSession to the ready route")

	// A message resumes the suspended session again; its route fails.
	require.NoError(t, s.RouteLost(ctx, "s1", notice(3), session.ReasonSuspend))
	require.InDelta(t, 1, testutil.ToFloat64(m.suspended), 0, "a stop not yet verified is no suspend")
	_, err = s.Suspend(ctx, "s1", false)
	require.NoError(t, err)
	require.InDelta(t, 2, testutil.ToFloat64(m.suspended), 0)
	_, err = s.Send(ctx, "s1", "m1", "hello")
	require.NoError(t, err)
	waitIdle(t, s)
	c.Add(time.Second)
	require.NoError(t, s.RouteFailed(ctx, "s1", notice(4), "wrapper_start_failed"))
	require.InDelta(t, 1, testutil.ToFloat64(m.resumes.WithLabelValues("failed")), 0)
	count, _ = histogram(t, reg, "agentplane_session_resume_duration_seconds")
	require.Equal(t, uint64(1), count, "a failed resume has no latency")
	require.InDelta(t, 1, testutil.ToFloat64(m.resumes.WithLabelValues("ready")), 0)
}

// histogram reads the sample count and sum of a histogram as scraped.
func histogram(t *testing.T, reg *prometheus.Registry, name string) (uint64, float64) {
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			require.Len(t, mf.GetMetric(), 1)
			h := mf.GetMetric()[0].GetHistogram()
			return h.GetSampleCount(), h.GetSampleSum()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0, 0
}
