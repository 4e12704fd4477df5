package service

import (
	"context"
	"io"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"agentplane.dev/pkg/redistest"
	"agentplane.dev/services/session/internal/session"
	"agentplane.dev/services/session/internal/store"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).reaper"))
}

// recordingSandbox accepts every delivery and records it.
type recordingSandbox struct {
	Sandbox
	mu        sync.Mutex
	delivered []string
}

// ClaimSandbox admits every tenant (tenancy is tested with the server).
func (r *recordingSandbox) ClaimSandbox(context.Context, string, session.Tenant) error { return nil }

func (r *recordingSandbox) CheckWorktree(context.Context, *session.Session) error { return nil }

func (r *recordingSandbox) Deliver(_ context.Context, _ *session.Session, msgs []*session.Message) (bool, session.RouteView, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, m := range msgs {
		r.delivered = append(r.delivered, m.ID)
	}
	return true, session.RouteView{}, nil
}

func (r *recordingSandbox) ids() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.delivered...)
}

func (s *Service) idle() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.running) == 0
}

func waitIdle(t *testing.T, s *Service) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second) // only stops a hung test
	for !s.idle() {
		require.False(t, time.Now().After(deadline), "drain did not finish")
		time.Sleep(time.Millisecond)
	}
}

// readySession is a service on rdb delivering to sbx, with session s1
// created and its route ready (no message yet).
func readySession(t *testing.T, rdb redis.UniversalClient, sbx Sandbox, logs io.Writer) *Service {
	ctx := context.Background()
	backstops := session.Backstops{QueuedFor: time.Hour, AcceptedFor: time.Hour}
	s := New(Deps{Store: store.New(rdb, 1000, backstops.NextDeadline), Sandbox: sbx,
		Logger: slog.New(slog.NewTextHandler(logs, nil))},
		Config{Backstops: backstops, PeerTimeout: 5 * time.Second})
	t.Cleanup(s.Close)
	sess, err := s.Create(ctx, CreateInput{ID: "s1", UserID: "u1", OrgID: "o1", Directory: "/w", Class: session.CredentialStatic, Secret: "x"})
	require.NoError(t, err)
	require.NoError(t, s.RouteReady(ctx, "s1", session.Notice{SandboxID: sess.SandboxID, FenceToken: 1}, "rt", "w1"))
	waitIdle(t, s)
	return s
}

// A drain may start from the state a transition committed, but never from
// one older than a drain that ended since: that state still shows delivered
// messages as queued, and they would go out twice.
func TestDrainIgnoresAStateOlderThanTheLastDrain(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.Start(t).Client(t)
	sbx := &recordingSandbox{}
	s := readySession(t, rdb, sbx, io.Discard)

	// A send whose kick is late: its committed state shows m1 queued.
	gen := s.drainGen("s1")
	stale, err := s.update(ctx, "s1", store.Load{MessageID: "m1"}, func(a *session.Aggregate) error {
		_, _, err := a.Send("m1", "hello", s.now())
		return err
	})
	require.NoError(t, err)
	s.kick("s1") // another kick delivers m1 meanwhile
	waitIdle(t, s)
	require.Equal(t, []string{"m1"}, sbx.ids())

	s.kickFrom("s1", stale, gen)
	waitIdle(t, s)
	require.Equal(t, []string{"m1"}, sbx.ids(), "m1 delivered once")

	// A state no drain has overtaken is used as is (and delivers).
	gen = s.drainGen("s1")
	fresh, err := s.update(ctx, "s1", store.Load{MessageID: "m2"}, func(a *session.Aggregate) error {
		_, _, err := a.Send("m2", "again", s.now())
		return err
	})
	require.NoError(t, err)
	s.kickFrom("s1", fresh, gen)
	waitIdle(t, s)
	require.Equal(t, []string{"m1", "m2"}, sbx.ids())
}

// A SendMessage whose first attempt stored the message but failed before
// it kicked a drain (its write not confirmed on a replica) is retried with
// the same id: the retry delivers the message, it does not wait for the
// redrive sweep.
func TestSendRetryOfAStoredMessageDelivers(t *testing.T) {
	ctx := context.Background()
	rdb := redistest.Start(t).Client(t)
	sbx := &recordingSandbox{}
	s := readySession(t, rdb, sbx, io.Discard)
	_, err := s.update(ctx, "s1", store.Load{MessageID: "m1"}, func(a *session.Aggregate) error {
		_, _, err := a.Send("m1", "hello", s.now()) // the first attempt: stored, no kick
		return err
	})
	require.NoError(t, err)

	m, err := s.Send(ctx, "s1", "m1", "hello")
	require.NoError(t, err)
	require.Equal(t, session.MessageQueued, m.State)
	waitIdle(t, s)
	require.Equal(t, []string{"m1"}, sbx.ids())
}

// outageSandbox accepts every delivery; its first takes Redis down (saved,
// so it comes back with its data) right after, as a Redis failover may.
type outageSandbox struct {
	recordingSandbox
	once   sync.Once
	srv    *redistest.Server
	rdb    interface{ Save(context.Context) error }
	killed chan struct{}
}

func (o *outageSandbox) Deliver(ctx context.Context, sess *session.Session, msgs []*session.Message) (bool, session.RouteView, error) {
	o.once.Do(func() {
		_ = o.rdb.Save(ctx)
		_ = o.srv.Kill()
		close(o.killed)
	})
	return o.recordingSandbox.Deliver(ctx, sess, msgs)
}

// A drain whose store read fails because Redis is away (a failover: the
// accept could not be saved, the reload finds no master) retries within its
// pauses instead of leaving the delivered message queued until its backstop.
func TestDrainRetriesAStoreOutage(t *testing.T) {
	ctx := context.Background()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	sbx := &outageSandbox{srv: srv, killed: make(chan struct{}),
		rdb: saver(func(ctx context.Context) error { return rdb.Save(ctx).Err() })}
	s := readySession(t, rdb, sbx, os.Stderr)
	_, err := s.update(ctx, "s1", store.Load{MessageID: "m1"}, func(a *session.Aggregate) error {
		_, _, err := a.Send("m1", "hello", s.now())
		return err
	})
	require.NoError(t, err)
	s.kick("s1")
	<-sbx.killed
	time.Sleep(5 * time.Second) // the accept and the reload fail meanwhile (longer than go-redis' own retries of each)
	srv.Start(t)
	waitIdle(t, s)

	a, err := s.store.Read(ctx, "s1", store.Load{MessageID: "m1"})
	require.NoError(t, err)
	require.Empty(t, a.Queued(), "m1 accepted after the outage, not left queued")
	require.Contains(t, sbx.ids(), "m1")
}

type saver func(context.Context) error

func (f saver) Save(ctx context.Context) error { return f(ctx) }

// A route a notification changed while Prepare or Deliver ran is not
// overwritten by their older answer, even when the notification carried the
// same time and state as the snapshot (a fake or coarse clock): the failure
// from a newer sandbox owner differs in its token and reason
// (TestRouteRules failed a loaded CI run on this).
func TestSameRouteSeesAChangeWithinOneClockTick(t *testing.T) {
	at := time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC)
	snap := session.RouteView{State: session.RouteFailed, FailureReason: "x", FenceToken: 5, UpdateTime: at}
	require.True(t, sameRoute(snap, snap))
	same := snap
	same.UpdateTime = at.In(time.FixedZone("elsewhere", 3600))
	require.True(t, sameRoute(same, snap), "one instant in another zone")
	newer := snap
	newer.FailureReason, newer.FenceToken = "capacity_rejected", 6
	require.False(t, sameRoute(newer, snap))
	later := snap
	later.UpdateTime = at.Add(time.Nanosecond)
	require.False(t, sameRoute(later, snap))
}
