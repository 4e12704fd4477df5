package service

import (
	"context"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"agentplane.dev/pkg/redistest"
	"agentplane.dev/pkg/testclock"
	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

// suspendingSandbox accepts deliveries and counts SuspendRoute calls;
// shared makes it refuse them as a shared runtime.
type suspendingSandbox struct {
	recordingSandbox
	suspends atomic.Int32
	shared   atomic.Bool
}

func (s *suspendingSandbox) SuspendRoute(context.Context, RouteRef) (bool, time.Duration, error) {
	if s.shared.Load() {
		return false, 0, session.ErrRuntimeShared
	}
	s.suspends.Add(1)
	return true, 0, nil
}

func suspendReplica(t *testing.T, rdb redis.UniversalClient, sbx Sandbox, c *testclock.Clock) *Service {
	backstops := session.Backstops{QueuedFor: time.Hour, AcceptedFor: time.Hour}
	s := New(Deps{Store: store.New(rdb, 1000, backstops.NextDeadline), Sandbox: sbx,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))},
		Config{Backstops: backstops, PeerTimeout: 5 * time.Second, Now: c.Now,
			Suspend: session.SuspendPolicy{Default: 2 * time.Minute}})
	t.Cleanup(s.Close)
	return s
}

// An idle session's runtime is suspended once suspend_after passed since
// its last turn ended, by one of two replicas sweeping at the same time;
// a message clears the schedule, the turn's outcome sets it again.
func TestIdleRuntimeIsSuspendedOnceAfterSuspendAfter(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.Start(t).Client(t)
	sbx := &suspendingSandbox{}
	c := testclock.New(time.Now())
	a, b := suspendReplica(t, rdb, sbx, c), suspendReplica(t, rdb, sbx, c)
	st := store.New(rdb, 1000, nil)

	sess, err := a.Create(ctx, CreateInput{ID: "s1", UserID: "u1", OrgID: "o1", Directory: "/w", Class: session.CredentialStatic, Secret: "x", SuspendAfter: 10 * time.Second})
	require.NoError(t, err)
	due, err := st.SuspendScheduled(ctx, "s1")
	require.NoError(t, err)
	require.True(t, due.IsZero(), "no runtime yet: nothing to suspend")
	n := session.Notice{SandboxID: sess.SandboxID, FenceToken: 1}
	require.NoError(t, a.RouteReady(ctx, "s1", n, "rt", "w1"))
	due, err = st.SuspendScheduled(ctx, "s1")
	require.NoError(t, err)
	require.Equal(t, c.Now().Add(10*time.Second).UnixMilli(), due.UnixMilli(), "the session's own suspend_after")

	// A turn: queued and running, nothing is due however long it runs.
	_, err = a.Send(ctx, "s1", "m1", "hello")
	require.NoError(t, err)
	waitIdle(t, a)
	due, err = st.SuspendScheduled(ctx, "s1")
	require.NoError(t, err)
	require.True(t, due.IsZero(), "a running turn is never suspended")
	c.Add(time.Hour)
	a.SuspendIdle(ctx)
	require.Zero(t, sbx.suspends.Load())

	require.NoError(t, a.TurnOutcome(ctx, "s1", n, Outcome{TurnID: "t1", LastMessageID: "m1", Result: session.TurnSucceeded}))
	end := c.Now()
	due, err = st.SuspendScheduled(ctx, "s1")
	require.NoError(t, err)
	require.Equal(t, end.Add(10*time.Second).UnixMilli(), due.UnixMilli(), "due suspend_after past the turn's end")

	c.Add(9 * time.Second)
	a.SuspendIdle(ctx)
	b.SuspendIdle(ctx)
	require.Zero(t, sbx.suspends.Load(), "not due yet")

	c.Add(time.Second)
	var wg sync.WaitGroup
	for _, r := range []*Service{a, b} {
		wg.Go(func() { r.SuspendIdle(ctx) })
	}
	wg.Wait()
	require.Equal(t, int32(1), sbx.suspends.Load(), "one replica suspends it")
	got, err := a.Get(ctx, "s1")
	require.NoError(t, err)
	require.Equal(t, session.RouteSuspended, got.Route.State)
	due, err = st.SuspendScheduled(ctx, "s1")
	require.NoError(t, err)
	require.True(t, due.IsZero(), "a suspended runtime is not scheduled")
	c.Add(time.Hour)
	a.SuspendIdle(ctx)
	require.Equal(t, int32(1), sbx.suspends.Load())
}

// A shared runtime stays up: its session is tried again when the claim
// ends, and a message meanwhile takes it off the schedule.
func TestSharedRuntimeIsLeftRunning(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.Start(t).Client(t)
	sbx := &suspendingSandbox{}
	sbx.shared.Store(true)
	c := testclock.New(time.Now())
	a := suspendReplica(t, rdb, sbx, c)
	st := store.New(rdb, 1000, nil)
	sess, err := a.Create(ctx, CreateInput{ID: "s1", UserID: "u1", OrgID: "o1", Directory: "/w", Class: session.CredentialStatic, Secret: "x"})
	require.NoError(t, err)
	require.NoError(t, a.RouteReady(ctx, "s1", session.Notice{SandboxID: sess.SandboxID, FenceToken: 1}, "rt", "w1"))

	c.Add(2 * time.Minute)
	a.SuspendIdle(ctx)
	got, err := a.Get(ctx, "s1")
	require.NoError(t, err)
	require.Equal(t, session.RouteReady, got.Route.State, "a shared runtime keeps running")
	due, err := st.SuspendScheduled(ctx, "s1")
	require.NoError(t, err)
	require.Equal(t, c.Now().Add(suspendLease).UnixMilli(), due.UnixMilli(), "tried again when the claim ends")

	sbx.shared.Store(false)
	c.Add(suspendLease)
	a.SuspendIdle(ctx)
	require.Equal(t, int32(1), sbx.suspends.Load())
	got, err = a.Get(ctx, "s1")
	require.NoError(t, err)
	require.Equal(t, session.RouteSuspended, got.Route.State)
}
