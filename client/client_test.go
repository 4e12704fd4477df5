package client

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"io"
	"math/big"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"

	"agentplane.dev/pkg/apierr"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
)

// These are unit tests of the client's own logic against a scripted
// in-memory server; the acceptance tests against the real suite are in
// cmd/agentplane/e2e/client_test.go.

// fake answers each call with the next scripted error of its method (nil
// once the script is used up) and records every request.
type fake struct {
	sessionv1.UnimplementedSessionServiceServer
	mu      sync.Mutex
	script  map[string][]error
	always  map[string]error // returned once the script is used up
	calls   map[string][]proto.Message
	started []time.Time // start of every call
	md      []metadata.MD
	watch   *watchLog
	// hangFrom: from this call on (1-based), the method answers only
	// when its caller gives up; hung gets each such call's number.
	hangFrom map[string]int
	hung     chan int
}

func newFake() *fake {
	return &fake{script: map[string][]error{}, always: map[string]error{}, calls: map[string][]proto.Message{}}
}

func (f *fake) next(ctx context.Context, method string, req proto.Message) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls[method] = append(f.calls[method], proto.Clone(req))
	f.started = append(f.started, time.Now())
	md, _ := metadata.FromIncomingContext(ctx)
	f.md = append(f.md, md)
	if from, n := f.hangFrom[method], len(f.calls[method]); from > 0 && n >= from {
		f.mu.Unlock()
		f.hung <- n
		<-ctx.Done()
		f.mu.Lock()
		return status.FromContextError(ctx.Err()).Err()
	}
	if s := f.script[method]; len(s) > 0 {
		f.script[method] = s[1:]
		return s[0]
	}
	return f.always[method]
}

func (f *fake) count(method string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.calls[method])
}

func (f *fake) CreateSession(ctx context.Context, r *sessionv1.CreateSessionRequest) (*sessionv1.CreateSessionResponse, error) {
	if err := f.next(ctx, "CreateSession", r); err != nil {
		return nil, err
	}
	return &sessionv1.CreateSessionResponse{Session: &sessionv1.Session{SessionId: r.GetSessionId()}}, nil
}

func (f *fake) GetSession(ctx context.Context, r *sessionv1.GetSessionRequest) (*sessionv1.GetSessionResponse, error) {
	if err := f.next(ctx, "GetSession", r); err != nil {
		return nil, err
	}
	return &sessionv1.GetSessionResponse{Session: &sessionv1.Session{SessionId: r.GetSessionId()}}, nil
}

func (f *fake) ListSessions(ctx context.Context, r *sessionv1.ListSessionsRequest) (*sessionv1.ListSessionsResponse, error) {
	if err := f.next(ctx, "ListSessions", r); err != nil {
		return nil, err
	}
	// Three pages of two: tokens "2", "4", then the end.
	var start int
	_, _ = fmt.Sscan(r.GetPageToken(), &start)
	resp := &sessionv1.ListSessionsResponse{}
	for i := start; i < start+2; i++ {
		resp.Sessions = append(resp.Sessions, &sessionv1.Session{SessionId: fmt.Sprintf("s%d", i)})
	}
	if start+2 < 6 {
		resp.NextPageToken = fmt.Sprint(start + 2)
	}
	return resp, nil
}

func (f *fake) ListAuditRecords(ctx context.Context, r *sessionv1.ListAuditRecordsRequest) (*sessionv1.ListAuditRecordsResponse, error) {
	if err := f.next(ctx, "ListAuditRecords", r); err != nil {
		return nil, err
	}
	// Two pages of two: token "2", then the end.
	var start int
	_, _ = fmt.Sscan(r.GetPageToken(), &start)
	resp := &sessionv1.ListAuditRecordsResponse{}
	for i := start; i < start+2; i++ {
		resp.Records = append(resp.Records, &sessionv1.AuditRecord{RecordId: fmt.Sprintf("r%d", i), TurnId: r.GetTurnId()})
	}
	if start+2 < 4 {
		resp.NextPageToken = fmt.Sprint(start + 2)
	}
	return resp, nil
}

func (f *fake) SendMessage(ctx context.Context, r *sessionv1.SendMessageRequest) (*sessionv1.SendMessageResponse, error) {
	if err := f.next(ctx, "SendMessage", r); err != nil {
		return nil, err
	}
	return &sessionv1.SendMessageResponse{Message: &sessionv1.Message{SessionId: r.GetSessionId(), MessageId: r.GetMessageId(), Content: r.GetContent()}}, nil
}

func (f *fake) DeleteSession(ctx context.Context, r *sessionv1.DeleteSessionRequest) (*sessionv1.DeleteSessionResponse, error) {
	if err := f.next(ctx, "DeleteSession", r); err != nil {
		return nil, err
	}
	return &sessionv1.DeleteSessionResponse{}, nil
}

// watchLog is a session's event log; each stream sends the events after
// its cursor and then breaks after `per` events, with the next break error.
type watchLog struct {
	events []*sessionv1.SessionEvent
	per    int
	breaks []error // io.EOF: the handler returns nil (a clean end)
}

func (f *fake) WatchSession(r *sessionv1.WatchSessionRequest, stream sessionv1.SessionService_WatchSessionServer) error {
	if err := f.next(stream.Context(), "WatchSession", r); err != nil {
		return err
	}
	f.mu.Lock()
	w := f.watch
	f.mu.Unlock()
	start := 0
	if r.GetCursor() != "" {
		for i, e := range w.events {
			if e.GetCursor() == r.GetCursor() {
				start = i + 1
			}
		}
	}
	for i := start; i < len(w.events); i++ {
		if err := stream.Send(&sessionv1.WatchSessionResponse{Event: w.events[i]}); err != nil {
			return err
		}
		if (i-start+1)%w.per == 0 && i+1 < len(w.events) {
			f.mu.Lock()
			brk := w.breaks[0]
			w.breaks = append(w.breaks[1:], brk)
			f.mu.Unlock()
			if brk == io.EOF { //nolint:errorlint // a marker value, never wrapped
				return nil
			}
			return brk
		}
	}
	<-stream.Context().Done()
	return nil
}

func startFake(t *testing.T, f *fake, opts ...Option) *Client {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	srv := grpc.NewServer()
	sessionv1.RegisterSessionServiceServer(srv, f)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	opts = append([]Option{WithDialOptions(grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
		return lis.DialContext(ctx)
	}))}, opts...)
	c, err := Dial("passthrough:///bufconn", opts...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func unavailable(retryAfter time.Duration) error {
	if retryAfter == 0 {
		return status.Error(codes.Unavailable, "connection refused")
	}
	return apierr.Error(codes.Unavailable, ReasonPeerUnavailable, "credential service unavailable", apierr.RetryAfter(retryAfter))
}

func pendingCleanup(retryAfter time.Duration) error {
	return apierr.Error(codes.FailedPrecondition, ReasonDeletionPendingCleanup, "cleanup pending",
		apierr.RetryAfter(retryAfter), apierr.Metadata("pending_step", "verify_absence"))
}

func notFound() error {
	return apierr.Error(codes.NotFound, ReasonSessionNotFound, "session not found", apierr.FieldViolation("session_id", "unknown"))
}

type hookLog struct {
	mu      sync.Mutex
	retries []Retry
}

func (h *hookLog) hook(r Retry) { h.mu.Lock(); h.retries = append(h.retries, r); h.mu.Unlock() }

func (h *hookLog) all() []Retry {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]Retry(nil), h.retries...)
}

func TestRetryWaitsWhatRetryInfoSays(t *testing.T) {
	f := newFake()
	f.script["GetSession"] = []error{unavailable(70 * time.Millisecond), status.Error(codes.Unavailable, "transport"), nil}
	var h hookLog
	c := startFake(t, f, WithRetryHook(h.hook))
	s, err := c.GetSession(t.Context(), &sessionv1.GetSessionRequest{SessionId: "s1"})
	require.NoError(t, err)
	require.Equal(t, "s1", s.GetSessionId())
	require.Equal(t, 3, f.count("GetSession"))
	r := h.all()
	require.Len(t, r, 2)
	require.Equal(t, 70*time.Millisecond, r[0].Delay, "the RetryInfo delay, exactly")
	require.Equal(t, "GetSession", r[0].Method)
	second := 2 * DefaultRetryPolicy.InitialBackoff // after the second failure
	require.InDelta(t, float64(second), float64(r[1].Delay), 0.2*float64(second), "no RetryInfo: the backoff")
}

func TestRetryableReasons(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{status.Error(codes.Unavailable, "down"), true},
		{unavailable(time.Second), true},
		{apierr.Error(codes.Aborted, ReasonSessionBusy, "busy"), true},
		{apierr.Error(codes.ResourceExhausted, "CAPACITY_REJECTED", "full", apierr.RetryAfter(time.Second)), true},
		{pendingCleanup(time.Second), true},
		{apierr.Error(codes.Aborted, "OTHER", "aborted"), false},
		{notFound(), false},
		{apierr.Error(codes.InvalidArgument, ReasonInvalidRequest, "bad"), false},
		{apierr.Error(codes.Internal, "INTERNAL", "internal error"), false},
		{status.Error(codes.DeadlineExceeded, "late"), false},
		{fmt.Errorf("wrapped: %w", status.Error(codes.Unavailable, "down")), true},
		{nil, false},
	} {
		require.Equal(t, tc.want, Retryable(tc.err), "%v", tc.err)
	}
}

func TestNonRetryableErrorReturnsAtOnce(t *testing.T) {
	f := newFake()
	f.always["GetSession"] = notFound()
	c := startFake(t, f)
	_, err := c.GetSession(t.Context(), &sessionv1.GetSessionRequest{SessionId: "nope"})
	require.Equal(t, ReasonSessionNotFound, Reason(err))
	require.Equal(t, 1, f.count("GetSession"))
}

func TestRetriesAreBounded(t *testing.T) {
	f := newFake()
	f.always["GetSession"] = unavailable(time.Millisecond)
	c := startFake(t, f, WithRetryPolicy(RetryPolicy{MaxAttempts: 4, InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond}))
	_, err := c.GetSession(t.Context(), &sessionv1.GetSessionRequest{SessionId: "s1"})
	require.Equal(t, codes.Unavailable, status.Code(err))
	require.Equal(t, 4, f.count("GetSession"))
}

// Retries stop at the context's deadline: no attempt starts after it, and
// a RetryInfo delay that would end after it is not waited for at all.
func TestRetriesStopAtTheDeadline(t *testing.T) {
	// The waits run on a controlled clock: each one moves it forward by its
	// delay at once, so the rule (a wait that would end past the deadline is
	// not taken, no attempt starts after it) shows as a count of attempts,
	// whatever the load of the machine.
	f := newFake()
	f.always["GetSession"] = unavailable(10 * time.Minute) // RetryInfo: no jitter
	c := startFake(t, f, WithRetryPolicy(RetryPolicy{MaxAttempts: 1_000_000, InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond}))
	now := time.Now()
	var mu sync.Mutex
	var waited []time.Duration
	c.clock = clock{
		now: func() time.Time { mu.Lock(); defer mu.Unlock(); return now },
		sleep: func(_ context.Context, d time.Duration) bool {
			mu.Lock()
			defer mu.Unlock()
			now = now.Add(d)
			waited = append(waited, d)
			return true
		},
	}
	for _, left := range []time.Duration{time.Hour, 65 * time.Minute, 69*time.Minute + 59*time.Second} {
		f.mu.Lock()
		f.calls = map[string][]proto.Message{}
		f.mu.Unlock()
		mu.Lock()
		start := now
		waited = nil
		mu.Unlock()
		ctx, cancel := context.WithDeadline(t.Context(), start.Add(left))
		_, err := c.GetSession(ctx, &sessionv1.GetSessionRequest{SessionId: "s1"})
		cancel()
		require.Equal(t, codes.Unavailable, status.Code(err), "the server's last error: %v", err)
		// Attempts at 0, 10, ..., 60 minutes; the wait after the one at 60
		// would end past the deadline.
		require.Equal(t, 7, f.count("GetSession"), "deadline %v after the start", left)
		mu.Lock()
		require.Len(t, waited, 6)
		require.False(t, now.After(start.Add(left)), "the last attempt started by the deadline")
		mu.Unlock()
	}

	// A delay longer than the time left: one attempt, no wait.
	f2 := newFake()
	f2.always["GetSession"] = unavailable(time.Hour)
	var h hookLog
	c2 := startFake(t, f2, WithRetryHook(h.hook))
	ctx2, cancel2 := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel2()
	_, err := c2.GetSession(ctx2, &sessionv1.GetSessionRequest{SessionId: "s1"})
	require.Equal(t, codes.Unavailable, status.Code(err))
	require.Equal(t, 1, f2.count("GetSession"))
	require.Empty(t, h.all(), "no wait was started")
	require.NoError(t, ctx2.Err(), "returned long before the deadline")
}

// A lost response after the server stored the message: the retry carries
// the same client-made id, so the message is stored once.
func TestSendMessageMakesOneIDForAllAttempts(t *testing.T) {
	f := newFake()
	f.script["SendMessage"] = []error{unavailable(0), unavailable(0)}
	c := startFake(t, f, WithRetryPolicy(RetryPolicy{MaxAttempts: 5, InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond}))
	req := &sessionv1.SendMessageRequest{SessionId: "s1", Content: "hello"}
	m, err := c.SendMessage(t.Context(), req)
	require.NoError(t, err)
	require.Empty(t, req.GetMessageId(), "the caller's request is not modified")
	require.Regexp(t, `^msg-[0-9a-f]{24}$`, m.GetMessageId())
	f.mu.Lock()
	calls := f.calls["SendMessage"]
	f.mu.Unlock()
	require.Len(t, calls, 3)
	for _, call := range calls {
		require.Equal(t, m.GetMessageId(), call.(*sessionv1.SendMessageRequest).GetMessageId())
	}

	// A given id is kept; two calls without one get two ids.
	m2, err := c.SendMessage(t.Context(), &sessionv1.SendMessageRequest{SessionId: "s1", MessageId: "mine", Content: "x"})
	require.NoError(t, err)
	require.Equal(t, "mine", m2.GetMessageId())
	m3, err := c.SendMessage(t.Context(), req)
	require.NoError(t, err)
	require.NotEqual(t, m.GetMessageId(), m3.GetMessageId())
}

func TestCreateSessionMakesOneIDForAllAttempts(t *testing.T) {
	f := newFake()
	f.script["CreateSession"] = []error{unavailable(time.Millisecond)}
	c := startFake(t, f)
	s, err := c.CreateSession(t.Context(), &sessionv1.CreateSessionRequest{UserId: "u", OrgId: "o"})
	require.NoError(t, err)
	require.Regexp(t, `^ses-[0-9a-f]{24}$`, s.GetSessionId())
	f.mu.Lock()
	defer f.mu.Unlock()
	require.Len(t, f.calls["CreateSession"], 2)
	for _, call := range f.calls["CreateSession"] {
		require.Equal(t, s.GetSessionId(), call.(*sessionv1.CreateSessionRequest).GetSessionId())
	}
}

func TestListSessionsPages(t *testing.T) {
	f := newFake()
	f.script["ListSessions"] = []error{nil, unavailable(time.Millisecond)} // the second page is retried
	c := startFake(t, f)
	var ids []string
	for s, err := range c.ListSessions(t.Context(), &sessionv1.ListSessionsRequest{OrgId: "o"}) {
		require.NoError(t, err)
		ids = append(ids, s.GetSessionId())
	}
	require.Equal(t, []string{"s0", "s1", "s2", "s3", "s4", "s5"}, ids)
	require.Equal(t, 4, f.count("ListSessions"))
}

func TestListAuditRecordsPages(t *testing.T) {
	f := newFake()
	f.script["ListAuditRecords"] = []error{nil, unavailable(time.Millisecond)} // the second page is retried
	c := startFake(t, f)
	var ids []string
	for r, err := range c.ListAuditRecords(t.Context(), &sessionv1.ListAuditRecordsRequest{SessionId: "s", TurnId: "m1"}) {
		require.NoError(t, err)
		require.Equal(t, "m1", r.GetTurnId())
		ids = append(ids, r.GetRecordId())
	}
	require.Equal(t, []string{"r0", "r1", "r2", "r3"}, ids)
	require.Equal(t, 3, f.count("ListAuditRecords"))
}

// DeleteSession waits through DELETION_PENDING_CLEANUP for as long as it
// lasts (the attempts bound other errors only), at the RetryInfo delay.
func TestDeleteSessionWaitsThroughPendingCleanup(t *testing.T) {
	f := newFake()
	f.script["DeleteSession"] = []error{pendingCleanup(10 * time.Millisecond), pendingCleanup(20 * time.Millisecond),
		pendingCleanup(10 * time.Millisecond), unavailable(0), nil}
	var h hookLog
	c := startFake(t, f, WithRetryHook(h.hook), WithRetryPolicy(RetryPolicy{MaxAttempts: 2, InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond}))
	require.NoError(t, c.DeleteSession(t.Context(), &sessionv1.DeleteSessionRequest{SessionId: "s1"}))
	require.Equal(t, 5, f.count("DeleteSession"))
	r := h.all()
	require.Len(t, r, 4)
	require.Equal(t, []time.Duration{10 * time.Millisecond, 20 * time.Millisecond, 10 * time.Millisecond}, []time.Duration{r[0].Delay, r[1].Delay, r[2].Delay})
	require.Equal(t, ReasonDeletionPendingCleanup, Reason(r[0].Err))
}

func TestDeleteSessionNotFoundAfterPendingIsDone(t *testing.T) {
	f := newFake()
	f.script["DeleteSession"] = []error{pendingCleanup(time.Millisecond), notFound()}
	c := startFake(t, f)
	require.NoError(t, c.DeleteSession(t.Context(), &sessionv1.DeleteSessionRequest{SessionId: "s1"}),
		"the reconciler finished between two calls")

	f2 := newFake()
	f2.always["DeleteSession"] = notFound()
	c2 := startFake(t, f2)
	err := c2.DeleteSession(t.Context(), &sessionv1.DeleteSessionRequest{SessionId: "nope"})
	require.Equal(t, ReasonSessionNotFound, Reason(err), "an unknown session is an error")
}

// When the caller gives up (a deadline or a cancel: both end the context)
// during a call that follows pending cleanups, the caller is told the
// deletion is pending, not that its own context ended. The third call
// hangs until the test cancels: no timer decides what the client sees.
func TestDeleteSessionStopsWhenTheCallerGivesUp(t *testing.T) {
	f := newFake()
	f.always["DeleteSession"] = pendingCleanup(time.Millisecond)
	f.hangFrom = map[string]int{"DeleteSession": 3}
	f.hung = make(chan int, 1)
	c := startFake(t, f)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	go func() { <-f.hung; cancel() }()
	err := c.DeleteSession(ctx, &sessionv1.DeleteSessionRequest{SessionId: "s1"})
	require.Equal(t, ReasonDeletionPendingCleanup, Reason(err), "%v", err)
	require.Equal(t, 3, f.count("DeleteSession"))
}

func events(n int) []*sessionv1.SessionEvent {
	var out []*sessionv1.SessionEvent
	for i := range n {
		out = append(out, &sessionv1.SessionEvent{Cursor: fmt.Sprintf("%d-0", 1000+i),
			Kind: &sessionv1.SessionEvent_Session{Session: &sessionv1.Session{SessionId: fmt.Sprint(i)}}})
	}
	return out
}

// The stream breaks every three events, alternately with a clean end (a
// server shutting down) and UNAVAILABLE; Watch yields every event once, in
// order, and each reopen starts after the last event it yielded.
func TestWatchResumesAfterEveryBreak(t *testing.T) {
	f := newFake()
	log := events(10)
	f.watch = &watchLog{events: log, per: 3, breaks: []error{io.EOF, status.Error(codes.Unavailable, "restarting")}}
	c := startFake(t, f)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var got []string
	for ev, err := range c.Watch(ctx, "s1", "") {
		require.NoError(t, err)
		got = append(got, ev.GetCursor())
		if len(got) == len(log) {
			break
		}
	}
	var want []string
	for _, e := range log {
		want = append(want, e.GetCursor())
	}
	require.Equal(t, want, got)
	f.mu.Lock()
	defer f.mu.Unlock()
	var from []string
	for _, r := range f.calls["WatchSession"] {
		from = append(from, r.(*sessionv1.WatchSessionRequest).GetCursor())
	}
	require.Equal(t, []string{"", "1002-0", "1005-0", "1008-0"}, from)
}

func TestWatchEndsWithErrorsAReconnectCannotFix(t *testing.T) {
	f := newFake()
	f.always["WatchSession"] = notFound()
	c := startFake(t, f)
	n := 0
	for ev, err := range c.Watch(t.Context(), "nope", "") {
		n++
		require.Nil(t, ev)
		require.Equal(t, ReasonSessionNotFound, Reason(err))
	}
	require.Equal(t, 1, n)
	require.Equal(t, 1, f.count("WatchSession"))
}

func TestWatchGivesUpAfterItsReconnectWindow(t *testing.T) {
	f := newFake()
	f.always["WatchSession"] = unavailable(0)
	c := startFake(t, f, WithRetryPolicy(RetryPolicy{MaxAttempts: 1, InitialBackoff: 5 * time.Millisecond, MaxBackoff: 5 * time.Millisecond, WatchReconnectWindow: 100 * time.Millisecond}))
	var last error
	for _, err := range c.Watch(t.Context(), "s1", "$") {
		last = err
	}
	require.Equal(t, codes.Unavailable, status.Code(last))
	require.Greater(t, f.count("WatchSession"), 2, "it reconnected within the window")
}

func TestWatchEndsWithTheContext(t *testing.T) {
	f := newFake()
	f.watch = &watchLog{events: events(1), per: 100, breaks: []error{io.EOF}}
	c := startFake(t, f)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var errs []error
	for ev, err := range c.Watch(ctx, "s1", "") {
		if ev != nil {
			cancel()
		}
		if err != nil {
			errs = append(errs, err)
		}
	}
	require.Len(t, errs, 1)
	require.ErrorIs(t, errs[0], context.Canceled)
}

// Every call carries the token and the caller's trace context.
func TestDialSendsTokenAndTraceContext(t *testing.T) {
	f := newFake()
	c := startFake(t, f, WithToken("tok-1"))
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	ctx := trace.ContextWithRemoteSpanContext(t.Context(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, Remote: true,
	}))
	_, err := c.GetSession(ctx, &sessionv1.GetSessionRequest{SessionId: "s1"})
	require.NoError(t, err)
	f.mu.Lock()
	md := f.md[0]
	f.mu.Unlock()
	require.Equal(t, []string{"Bearer tok-1"}, md.Get("authorization"))
	require.Len(t, md.Get("traceparent"), 1)
	require.True(t, strings.HasPrefix(md.Get("traceparent")[0], "00-"+tid.String()+"-"), md.Get("traceparent")[0])
}

func TestDialRejectsABadPolicy(t *testing.T) {
	_, err := Dial("127.0.0.1:1", WithRetryPolicy(RetryPolicy{MaxAttempts: 0}))
	require.ErrorIs(t, err, errBadPolicy)
}

// WithTLS dials with TLS: a client that trusts the server's certificate
// gets through, a plaintext one does not.
func TestDialWithTLS(t *testing.T) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "session.test"},
		DNSNames: []string{"session.test"}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	cert, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := grpc.NewServer(grpc.Creds(credentials.NewServerTLSFromCert(&tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key})))
	sessionv1.RegisterSessionServiceServer(srv, newFake())
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)

	roots := x509.NewCertPool()
	roots.AddCert(cert)
	c, err := Dial(lis.Addr().String(), WithTLS(&tls.Config{RootCAs: roots, ServerName: "session.test", MinVersion: tls.VersionTLS12}))
	require.NoError(t, err)
	defer c.Close()
	_, err = c.GetSession(t.Context(), &sessionv1.GetSessionRequest{SessionId: "s1"})
	require.NoError(t, err)

	plain, err := Dial(lis.Addr().String(), WithRetryPolicy(RetryPolicy{MaxAttempts: 1, InitialBackoff: time.Millisecond, MaxBackoff: time.Millisecond}))
	require.NoError(t, err)
	defer plain.Close()
	_, err = plain.GetSession(t.Context(), &sessionv1.GetSessionRequest{SessionId: "s1"})
	require.Equal(t, codes.Unavailable, status.Code(err), "plaintext against a TLS server: %v", err)
}

func TestNewOverACallersConnection(t *testing.T) {
	_, err := New(nil, WithRetryPolicy(RetryPolicy{}))
	require.ErrorIs(t, err, errBadPolicy)
}

// A watch cut by its context's deadline ends with context.DeadlineExceeded,
// whichever noticed the deadline first: the stream or the context.
func TestWatchEndsWithTheDeadline(t *testing.T) {
	f := newFake()
	f.watch = &watchLog{events: events(1), per: 100, breaks: []error{io.EOF}}
	c := startFake(t, f)
	for range 5 {
		ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
		var last error
		for _, err := range c.Watch(ctx, "s1", "") {
			last = err
		}
		cancel()
		require.ErrorIs(t, last, context.DeadlineExceeded)
	}
}
