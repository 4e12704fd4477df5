package notify

import (
	"bytes"
	"context"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	"agentplane.dev/pkg/logging/logtest"
	"agentplane.dev/services/sandbox/internal/control/driver"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// sessionService is a SessionNotifyService that records every call it
// receives as "kind session" and fails the next calls of a session with
// scripted codes.
type sessionService struct {
	sessionv1.UnimplementedSessionNotifyServiceServer

	mu        sync.Mutex
	fail      map[string][]codes.Code // session id → codes of its next calls
	attempts  []string                // every call, in arrival order
	delivered []string                // calls answered OK, in arrival order
	events    map[string][]string     // session id → ids of its delivered events
	hold      chan struct{}           // non-nil: every call waits for it to close after it is recorded
}

func (s *sessionService) receive(kind string, r *sessionv1.RouteRef) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	call := kind + " " + r.GetSessionId()
	s.attempts = append(s.attempts, call)
	if s.hold != nil {
		s.mu.Unlock()
		<-s.hold
		s.mu.Lock()
	}
	if next := s.fail[r.GetSessionId()]; len(next) > 0 {
		s.fail[r.GetSessionId()] = next[1:]
		return status.Error(next[0], "scripted failure")
	}
	s.delivered = append(s.delivered, call)
	return nil
}

func (s *sessionService) calls() (attempts, delivered []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.attempts...), append([]string(nil), s.delivered...)
}

func (s *sessionService) NotifyRouteProgress(_ context.Context, r *sessionv1.NotifyRouteProgressRequest) (*sessionv1.NotifyRouteProgressResponse, error) {
	return &sessionv1.NotifyRouteProgressResponse{}, s.receive("progress", r.GetRoute())
}

func (s *sessionService) NotifyRouteReady(_ context.Context, r *sessionv1.NotifyRouteReadyRequest) (*sessionv1.NotifyRouteReadyResponse, error) {
	return &sessionv1.NotifyRouteReadyResponse{}, s.receive("ready", r.GetRoute())
}

func (s *sessionService) NotifyRouteReconnecting(_ context.Context, r *sessionv1.NotifyRouteReconnectingRequest) (*sessionv1.NotifyRouteReconnectingResponse, error) {
	return &sessionv1.NotifyRouteReconnectingResponse{}, s.receive("reconnecting", r.GetRoute())
}

func (s *sessionService) NotifyRouteFailed(_ context.Context, r *sessionv1.NotifyRouteFailedRequest) (*sessionv1.NotifyRouteFailedResponse, error) {
	return &sessionv1.NotifyRouteFailedResponse{}, s.receive("failed", r.GetRoute())
}

func (s *sessionService) NotifyRouteLost(_ context.Context, r *sessionv1.NotifyRouteLostRequest) (*sessionv1.NotifyRouteLostResponse, error) {
	return &sessionv1.NotifyRouteLostResponse{}, s.receive("lost", r.GetRoute())
}

func (s *sessionService) NotifyRuntimeEvents(_ context.Context, r *sessionv1.NotifyRuntimeEventsRequest) (*sessionv1.NotifyRuntimeEventsResponse, error) {
	err := s.receive("events", r.GetRoute())
	if err == nil {
		s.mu.Lock()
		if s.events == nil {
			s.events = map[string][]string{}
		}
		for _, e := range r.GetEvents() {
			s.events[r.GetRoute().GetSessionId()] = append(s.events[r.GetRoute().GetSessionId()], e.GetEventId())
		}
		s.mu.Unlock()
	}
	return &sessionv1.NotifyRuntimeEventsResponse{}, err
}

// eventIDs is the ids of the events delivered for a session, in order.
func (s *sessionService) eventIDs(session string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.events[session]...)
}

func (s *sessionService) NotifyTurnOutcome(_ context.Context, r *sessionv1.NotifyTurnOutcomeRequest) (*sessionv1.NotifyTurnOutcomeResponse, error) {
	return &sessionv1.NotifyTurnOutcomeResponse{}, s.receive("outcome", r.GetRoute())
}

// startNotifier serves svc over bufconn and runs a notifier against it
// until the test ends.
func startNotifier(t *testing.T, svc *sessionService, giveUp time.Duration) *Notifier {
	t.Helper()
	n := New(serve(t, svc), slog.New(slog.NewTextHandler(t.Output(), nil)), giveUp)
	run(t, n)
	return n
}

// serve serves svc over bufconn until the test ends.
func serve(t *testing.T, svc *sessionService) sessionv1.SessionNotifyServiceClient {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	srv := grpc.NewServer()
	sessionv1.RegisterSessionNotifyServiceServer(srv, svc)
	go func() { _ = srv.Serve(lis) }()
	conn, err := grpc.NewClient("passthrough:///session",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(srv.Stop)
	t.Cleanup(func() { _ = conn.Close() })
	return sessionv1.NewSessionNotifyServiceClient(conn)
}

// run runs n until stop is called or the test ends; stop returns once Run
// has returned.
func run(t *testing.T, n *Notifier) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	go func() { defer close(stopped); n.Run(ctx) }()
	stop = func() { cancel(); <-stopped }
	t.Cleanup(stop)
	return stop
}

func ref(session string) driver.RouteRef {
	return driver.RouteRef{SessionID: session, SandboxID: "sb1", AllocationID: "a1", FenceToken: 7}
}

func TestSendsInOrderRaised(t *testing.T) {
	svc := &sessionService{}
	n := startNotifier(t, svc, 0)

	n.Progress(ref("s1"), driver.ProgressStep{})
	n.Ready(ref("s1"), "rs1", "w1")
	n.Events(ref("s1"), nil)
	n.Outcome(ref("s1"), driver.TurnOutcome{})
	n.Reconnecting(ref("s1"))
	n.Lost(ref("s1"), "wrapper gone")
	n.Failed(ref("s2"), "clone failed", true)
	n.Flush()

	attempts, delivered := svc.calls()
	want := []string{"progress s1", "ready s1", "events s1", "outcome s1", "reconnecting s1", "lost s1"}
	require.Equal(t, want, only(delivered, "s1"), "a session's notifications in the order raised")
	require.Equal(t, want, only(attempts, "s1"))
	require.Equal(t, []string{"failed s2"}, only(delivered, "s2"))
}

func TestRetriesUnavailableAndTheSessionsNextWait(t *testing.T) {
	svc := &sessionService{fail: map[string][]codes.Code{"s1": {codes.Unavailable, codes.Unavailable}}}
	n := startNotifier(t, svc, 0)

	n.Ready(ref("s1"), "rs1", "w1")
	n.Lost(ref("s1"), "wrapper gone")
	n.Lost(ref("s2"), "wrapper gone")
	n.Flush()

	attempts, delivered := svc.calls()
	require.Equal(t, []string{"ready s1", "ready s1", "ready s1", "lost s1"}, only(attempts, "s1"), "s1's next waits for its first")
	require.ElementsMatch(t, []string{"ready s1", "lost s1", "lost s2"}, delivered)
	require.Equal(t, []string{"ready s1", "lost s1"}, only(delivered, "s1"))
}

// only is the calls of one session, in order.
func only(calls []string, session string) []string {
	var out []string
	for _, c := range calls {
		if strings.HasSuffix(c, " "+session) {
			out = append(out, c)
		}
	}
	return out
}

// Issue 33 item 3: one session's notification that keeps failing held the
// single worker, and every other session's notifications waited behind
// it. Here s1's progress fails Unavailable throughout while another session
// raises 20,000 event batches: they are all delivered, in order, while s1's
// is still being retried.
func TestAFailingSessionDoesNotHoldTheOthers(t *testing.T) {
	svc := unavailable()
	n := startNotifier(t, svc, 0)
	n.Progress(ref("s1"), driver.ProgressStep{})
	for i := range 20000 {
		n.Events(ref("s2"), []driver.RuntimeEvent{{ID: strconv.Itoa(i)}})
	}
	// The bound only stops a hung test: old code sent nothing of s2 while
	// s1 was retried for giveUp (5 minutes).
	require.Eventually(t, func() bool { return len(svc.eventIDs("s2")) == 20000 }, 2*time.Minute, 10*time.Millisecond)
	ids := svc.eventIDs("s2")
	for i, id := range ids {
		require.Equal(t, strconv.Itoa(i), id, "s2's events in the order raised")
	}
	_, delivered := svc.calls()
	require.Empty(t, only(delivered, "s1"), "s1 is still being retried")
	require.Equal(t, 1, n.Depth(), "only s1's notification is left")
	require.Zero(t, n.Dropped())
}

// Internal and Unknown are not retried for giveUp: a few attempts, then
// dropped and counted.
func TestInternalIsNotEndlesslyRetried(t *testing.T) {
	svc := &sessionService{fail: map[string][]codes.Code{"s1": {codes.Internal, codes.Internal, codes.Internal, codes.Internal}}}
	n := startNotifier(t, svc, 0)
	n.Progress(ref("s1"), driver.ProgressStep{})
	n.Flush()
	attempts, delivered := svc.calls()
	require.Equal(t, []string{"progress s1", "progress s1", "progress s1"}, attempts)
	require.Empty(t, delivered)
	require.Equal(t, uint64(1), n.Dropped())
}

// The bound: past MaxLaneItems queued for one session, its progress is
// dropped and counted, while its route states are still queued.
func TestTheQueueIsBounded(t *testing.T) {
	n := New(nil, slog.New(slog.DiscardHandler), 0) // not running: everything stays queued
	for range MaxLaneItems + 10 {
		n.Progress(ref("s1"), driver.ProgressStep{})
	}
	require.Equal(t, MaxLaneItems, n.Depth())
	require.Equal(t, uint64(10), n.Dropped())
	n.Lost(ref("s1"), "wrapper gone")
	require.Equal(t, MaxLaneItems+1, n.Depth(), "a route state is never dropped by the bound")
	require.Zero(t, n.Drain(context.Background()))
	require.Zero(t, n.Depth())
}

func TestDropsNonRetryableAndSendsTheNext(t *testing.T) {
	svc := &sessionService{fail: map[string][]codes.Code{"s1": {codes.InvalidArgument}}}
	n := startNotifier(t, svc, 0)

	n.Failed(ref("s1"), "bad", false)
	n.Progress(ref("s2"), driver.ProgressStep{})
	n.Flush()

	attempts, delivered := svc.calls()
	require.ElementsMatch(t, []string{"failed s1", "progress s2"}, attempts, "InvalidArgument is not retried")
	require.Equal(t, []string{"progress s2"}, delivered)
}

func TestGivesUpAfterGiveUp(t *testing.T) {
	// A giveUp of 1ns has passed by the time the first call fails, so the
	// notification is dropped after one attempt instead of being retried.
	svc := &sessionService{fail: map[string][]codes.Code{"s1": {codes.Unavailable, codes.Unavailable, codes.Unavailable}}}
	n := startNotifier(t, svc, time.Nanosecond)

	n.Ready(ref("s1"), "rs1", "w1")
	n.Outcome(ref("s2"), driver.TurnOutcome{})
	n.Flush()

	attempts, delivered := svc.calls()
	require.ElementsMatch(t, []string{"ready s1", "outcome s2"}, attempts)
	require.Equal(t, []string{"outcome s2"}, delivered)
}

func TestNilClientOnlyLogs(t *testing.T) {
	var logs bytes.Buffer
	n := New(nil, slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})), 0)
	run(t, n)

	n.Ready(ref("s1"), "rs1", "w1")
	n.Lost(ref("s2"), "wrapper gone")
	n.Flush() // returns: with no client every notification is done once logged

	require.Contains(t, logs.String(), `msg="route notification" kind=ready session=s1 sandbox=sb1`)
	require.Contains(t, logs.String(), `msg="route notification" kind=lost session=s2 sandbox=sb1`)
	require.NotContains(t, logs.String(), "dropped")
}

func TestFlushWithNothingQueuedReturns(t *testing.T) {
	svc := &sessionService{}
	n := startNotifier(t, svc, 0)
	n.Flush()
	attempts, _ := svc.calls()
	require.Empty(t, attempts)
}

func TestFlushWaitsForNotificationsRaisedBeforeRun(t *testing.T) {
	// Notifications raised before Run starts are queued, not lost: Flush
	// returns once Run has sent them.
	var logs bytes.Buffer
	n := New(nil, slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})), 0)
	n.Ready(ref("s1"), "rs1", "w1")
	run(t, n)
	n.Flush()
	require.Contains(t, logs.String(), "kind=ready session=s1")
}

// unavailable returns a session service that answers Unavailable to the
// first 1000 calls of session s1.
func unavailable() *sessionService {
	svc := &sessionService{fail: map[string][]codes.Code{"s1": make([]codes.Code, 1000)}}
	for i := range svc.fail["s1"] {
		svc.fail["s1"][i] = codes.Unavailable
	}
	return svc
}

func TestStopsRetryingWhenRunEnds(t *testing.T) {
	// The session service stays unavailable: once Run's context ends, Run
	// returns without waiting out giveUp, and the notification being
	// retried and the one queued behind it stay queued for Drain.
	svc := unavailable()
	n := New(serve(t, svc), slog.New(slog.NewTextHandler(t.Output(), nil)), 0)
	stop := run(t, n)

	n.Ready(ref("s1"), "rs1", "w1")
	n.Lost(ref("s1"), "wrapper gone")
	require.Eventually(t, func() bool { attempts, _ := svc.calls(); return len(attempts) > 0 }, 10*time.Second, time.Millisecond)
	stop()

	attempts, delivered := svc.calls()
	require.Empty(t, delivered)
	require.NotContains(t, attempts, "lost s1", "the session's next waits for its first")
	require.Equal(t, 2, n.Depth(), "both notifications wait for Drain")
}

func TestStopsWhenRunEndsDuringASend(t *testing.T) {
	// Run's context ends while a notification is being sent: the send
	// fails with it and the notification stays first for Drain. Run
	// returns; it used to take that lane again at once (no backoff was
	// set) and fail again, forever, so the sandbox service's shutdown
	// never ended.
	svc := &sessionService{fail: map[string][]codes.Code{}, hold: make(chan struct{})}
	n := New(serve(t, svc), slog.New(slog.NewTextHandler(t.Output(), nil)), 0)
	t.Cleanup(func() { close(svc.hold) }) // before the server stops
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	go func() { defer close(stopped); n.Run(ctx) }()

	n.Reconnecting(ref("s1"))
	require.Eventually(t, func() bool { attempts, _ := svc.calls(); return len(attempts) == 1 }, 10*time.Second, time.Millisecond,
		"the send is in flight")
	cancel()
	select {
	case <-stopped:
	case <-time.After(time.Minute): // a bound against hanging, not a measure
		t.Fatal("Run did not return after its context ended during a send")
	}
	attempts, delivered := svc.calls()
	require.Equal(t, []string{"reconnecting s1"}, attempts, "not sent again after Run's end")
	require.Empty(t, delivered)
	require.Equal(t, 1, n.Depth(), "the notification waits for Drain")
}

func TestDrainSendsWhatRunLeftInOrder(t *testing.T) {
	// Run ends while the first notification is being retried (a restart of
	// the sandbox replica); the session service comes back and Drain
	// delivers it and everything raised after, in order.
	svc := unavailable()
	n := New(serve(t, svc), slog.New(slog.NewTextHandler(t.Output(), nil)), 0)
	stop := run(t, n)

	n.Outcome(ref("s1"), driver.TurnOutcome{})
	require.Eventually(t, func() bool { attempts, _ := svc.calls(); return len(attempts) > 0 }, 10*time.Second, time.Millisecond)
	stop()
	n.Lost(ref("s2"), "wrapper gone") // raised by the driver's last act
	svc.mu.Lock()
	svc.fail["s1"] = nil // the session service is back
	svc.mu.Unlock()

	require.Zero(t, n.Drain(context.Background()))
	n.Flush()
	_, delivered := svc.calls()
	require.Equal(t, []string{"outcome s1", "lost s2"}, delivered)
}

func TestDrainLeavesUnsentWhenItsContextEnds(t *testing.T) {
	// The session service never comes back: Drain gives up when its
	// context ends, counts and logs what it left, and Flush returns.
	svc := unavailable()
	var logs logtest.Buffer
	n := New(serve(t, svc), slog.New(slog.NewTextHandler(&logs, nil)), 0)
	n.Ready(ref("s1"), "rs1", "w1")
	n.Lost(ref("s1"), "wrapper gone")

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	require.Equal(t, 2, n.Drain(ctx))
	n.Flush()

	_, delivered := svc.calls()
	require.Empty(t, delivered)
	require.Contains(t, logs.String(), `msg="notification not sent at shutdown" kind=ready session=s1`)
	require.Contains(t, logs.String(), `msg="notification not sent at shutdown" kind=lost session=s1`)
}
