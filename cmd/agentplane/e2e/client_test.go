package e2e

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

	"agentplane.dev/client"
	"agentplane.dev/cmd/agentplane/internal/cli"
	"agentplane.dev/pkg/apierr"
	runtimev1 "agentplane.dev/pkg/gen/agentplane/runtime/v1"
	sessionv1 "agentplane.dev/pkg/gen/agentplane/session/v1"
	credential "agentplane.dev/services/credential/server"
	ingest "agentplane.dev/services/ingest/server"
	sandbox "agentplane.dev/services/sandbox/server"
	session "agentplane.dev/services/session/server"
)

// Acceptance tests of agentplane.dev/client (issue 23) against the four
// real services, a real redis-server, real wrappers and the scripted
// runtime. The services run one by one so a test can stop and restart one
// of them in the middle of a turn.

// service is one service that can be stopped and started again on the same
// address.
type service struct {
	name  string
	run   func(context.Context) error
	mu    sync.Mutex
	stopF func()
}

func (s *service) start(t testing.TB) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.run(ctx) }()
	s.mu.Lock()
	s.stopF = func() {
		cancel()
		require.NoError(t, <-done, "%s stopped with an error", s.name)
	}
	s.mu.Unlock()
}

func (s *service) stop() {
	s.mu.Lock()
	stop := s.stopF
	s.stopF = nil
	s.mu.Unlock()
	if stop != nil {
		stop()
	}
}

// restartable is the suite with each service on its own.
type restartable struct {
	session, sandbox, credential, ingest *service
	addr                                 string // session service
	run                                  string
}

func startRestartable(t *testing.T) *restartable {
	st := newStack(t, stackOptions{})
	captureStderr(t)
	// Each service restarts on its own address: no held listeners.
	st.releaseListeners()
	st.set(svcSession, "SHUTDOWN_TIMEOUT", "2s",
		// Pending deletions are tried again soon, so a test waits seconds.
		"SESSION_DELETE_BACKOFF_BASE", "200ms", "SESSION_DELETE_BACKOFF_MAX", "1s", "SESSION_RECONCILE_INTERVAL", "200ms")
	c := st.configs()
	s := &restartable{
		credential: &service{name: "credential", run: func(ctx context.Context) error { return credential.Run(ctx, c.cred) }},
		ingest:     &service{name: "ingest", run: func(ctx context.Context) error { return ingest.Run(ctx, c.ing) }},
		sandbox:    &service{name: "sandbox", run: func(ctx context.Context) error { return sandbox.Run(ctx, c.sbx) }},
		session:    &service{name: "session", run: func(ctx context.Context) error { return session.Run(ctx, c.ses) }},
		addr:       st.addr[svcSession],
		run:        st.run,
	}
	for _, svc := range []*service{s.credential, s.ingest, s.sandbox, s.session} {
		svc.start(t)
	}
	t.Cleanup(func() {
		for _, svc := range []*service{s.sandbox, s.session, s.credential, s.ingest} {
			svc.stop()
		}
	})
	return s
}

// client dials the session service with the internal token.
func (s *restartable) client(t *testing.T, opts ...client.Option) *client.Client {
	c, err := client.Dial(s.addr, append([]client.Option{client.WithToken(token)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func (s *restartable) create(t *testing.T, c *client.Client, dir string) *sessionv1.Session {
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	sess, err := c.CreateSession(ctx, &sessionv1.CreateSessionRequest{
		UserId: "u-client", OrgId: "o-e2e", SandboxId: "sbx-client-" + s.run,
		Worktree:   &sessionv1.Worktree{Directory: dir},
		Credential: &sessionv1.CredentialInput{Class: sessionv1.CredentialClass_CREDENTIAL_CLASS_STATIC, Secret: newSecret()},
	})
	require.NoError(t, err)
	return sess
}

type retries struct {
	mu  sync.Mutex
	all []client.Retry
	at  []time.Time
}

func (r *retries) hook(x client.Retry) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.all, r.at = append(r.all, x), append(r.at, time.Now())
}

func (r *retries) of(method string) []client.Retry {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []client.Retry
	for _, x := range r.all {
		if x.Method == method {
			out = append(out, x)
		}
	}
	return out
}

// TestClientWatchResumesAcrossSessionRestart: a watcher follows a turn; the
// session service is stopped and started again in the middle of it (the
// server ends every stream); Watch reconnects after its last cursor. The
// events it yielded are exactly the session's log, as a fresh watch from
// the start reads it: none lost, none repeated (cursors and runtime event
// ids are unique).
func TestClientWatchResumesAcrossSessionRestart(t *testing.T) {
	s := startRestartable(t)
	var r retries
	c := s.client(t, client.WithRetryHook(r.hook))
	sess := s.create(t, c, "/work/client-watch")
	id := sess.GetSessionId()

	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	msg, err := c.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: id, Content: "slow: wait for the abort"})
	require.NoError(t, err)

	seen := make(chan *sessionv1.SessionEvent, 1024)
	watchErr := make(chan error, 1)
	go func() {
		defer close(seen)
		for ev, err := range c.Watch(ctx, id, "") {
			if err != nil {
				watchErr <- err
				return
			}
			seen <- ev
			if o := ev.GetOutcome(); o != nil && o.GetLastMessageId() == msg.GetMessageId() {
				return
			}
		}
	}()
	var got []*sessionv1.SessionEvent
	next := func(what string) *sessionv1.SessionEvent {
		select {
		case ev, ok := <-seen:
			if !ok {
				select {
				case err := <-watchErr:
					t.Fatalf("watch ended before %s: %v", what, err)
				default:
					t.Fatalf("watch ended before %s", what)
				}
			}
			got = append(got, ev)
			return ev
		case <-ctx.Done():
			t.Fatalf("no %s: %v", what, ctx.Err())
		}
		return nil
	}
	// Mid-turn: the runtime listed the files and now waits for an abort.
	for ev := next("the list_files result"); ev.GetRuntimeEvent().GetToolName() != "list_files" ||
		ev.GetRuntimeEvent().GetKind() != runtimev1.RuntimeEventKind_RUNTIME_EVENT_KIND_TOOL_RESULT; ev = next("the list_files result") {
	}
	before := len(got)

	s.session.stop()
	s.session.start(t)
	// The client's retries carry the cancel through the restart.
	_, err = c.CancelMessage(ctx, &sessionv1.CancelMessageRequest{SessionId: id, MessageId: msg.GetMessageId()})
	require.NoError(t, err)
	for ev := next("the outcome"); ev.GetOutcome() == nil; ev = next("the outcome") {
	}
	require.Equal(t, runtimev1.TurnResult_TURN_RESULT_CANCELLED, got[len(got)-1].GetOutcome().GetResult())
	require.Greater(t, len(got), before, "events came after the restart")
	require.NotEmpty(t, r.of("WatchSession"), "the stream broke and Watch reconnected")

	// The log as a fresh stream reads it, from the start.
	fresh, err := c.Raw().WatchSession(ctx, &sessionv1.WatchSessionRequest{SessionId: id})
	require.NoError(t, err)
	cursors, eventIDs := map[string]bool{}, map[string]bool{}
	for i, ev := range got {
		resp, err := fresh.Recv()
		require.NoError(t, err)
		require.Equal(t, resp.GetEvent().GetCursor(), ev.GetCursor(), "event %d: the resumed watch lost or repeated an event", i)
		require.False(t, cursors[ev.GetCursor()], "cursor %s seen twice", ev.GetCursor())
		cursors[ev.GetCursor()] = true
		if re := ev.GetRuntimeEvent(); re != nil {
			require.False(t, eventIDs[re.GetEventId()], "runtime event %s seen twice", re.GetEventId())
			eventIDs[re.GetEventId()] = true
		}
	}
	require.NotEmpty(t, eventIDs)
}

// TestClientRetriesStopAtTheDeadline: with the session service down, a
// call retries (UNAVAILABLE) until the context's deadline and no further:
// every wait it began ended before the deadline, so no attempt started
// after it, although the policy allowed a million attempts.
func TestClientRetriesStopAtTheDeadline(t *testing.T) {
	s := startRestartable(t)
	var r retries
	c := s.client(t, client.WithRetryHook(r.hook), client.WithRetryPolicy(client.RetryPolicy{
		MaxAttempts: 1_000_000, InitialBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond,
	}))
	sess := s.create(t, c, "/work/client-deadline")
	// A client with the default policy, connected before the outage.
	plain := s.client(t)
	_, err := plain.GetSession(t.Context(), &sessionv1.GetSessionRequest{SessionId: sess.GetSessionId()})
	require.NoError(t, err)
	s.session.stop()

	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
	defer cancel()
	deadline, _ := ctx.Deadline()
	_, err = c.GetSession(ctx, &sessionv1.GetSessionRequest{SessionId: sess.GetSessionId()})
	require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
	waits := r.of("GetSession")
	require.Greater(t, len(waits), 1, "it retried")
	r.mu.Lock()
	for i, at := range r.at {
		require.False(t, at.Add(r.all[i].Delay).After(deadline), "wait %d ended after the deadline", i)
	}
	r.mu.Unlock()

	// The default policy gives up while the service stays down; its
	// connection keeps failing meanwhile.
	for range 3 {
		_, err = plain.GetSession(t.Context(), &sessionv1.GetSessionRequest{SessionId: sess.GetSessionId()})
		require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
	}

	// Up again: the first call of either client gets through, although
	// their connections failed for seconds (the connection's own backoff
	// must not outlast the call's retries).
	s.session.start(t)
	for _, cl := range []*client.Client{plain, c} {
		got, err := cl.GetSession(t.Context(), &sessionv1.GetSessionRequest{SessionId: sess.GetSessionId()})
		require.NoError(t, err)
		require.Equal(t, sess.GetSessionId(), got.GetSessionId())
	}
}

// TestClientDeleteSessionWaitsThroughPendingCleanup: with the ingest service
// down the session's history cannot be deleted, so DeleteSession is answered
// DELETION_PENDING_CLEANUP; the client keeps calling at the RetryInfo delay
// and returns only once ingest is back and the deletion completed: the
// session is then NOT_FOUND and its wrapper gone.
func TestClientDeleteSessionWaitsThroughPendingCleanup(t *testing.T) {
	s := startRestartable(t)
	var r retries
	c := s.client(t, client.WithRetryHook(r.hook))
	sess := s.create(t, c, "/work/client-delete")
	id := sess.GetSessionId()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	msg, err := c.SendMessage(ctx, &sessionv1.SendMessageRequest{SessionId: id, Content: "hello"})
	require.NoError(t, err)
	for ev, err := range c.Watch(ctx, id, "") {
		require.NoError(t, err)
		if ev.GetOutcome().GetLastMessageId() == msg.GetMessageId() {
			break
		}
	}
	require.NotEmpty(t, wrapperPIDs(t, sess.GetSandboxId()))

	s.ingest.stop()
	deleted := make(chan error, 1)
	go func() { deleted <- c.DeleteSession(ctx, &sessionv1.DeleteSessionRequest{SessionId: id}) }()
	require.Eventually(t, func() bool {
		for _, x := range r.of("DeleteSession") {
			if client.Reason(x.Err) == client.ReasonDeletionPendingCleanup {
				return true
			}
		}
		return false
	}, 60*time.Second, 20*time.Millisecond, "DeleteSession was answered DELETION_PENDING_CLEANUP")
	select {
	case err := <-deleted:
		t.Fatalf("DeleteSession returned while the cleanup was pending: %v", err)
	default:
	}
	got, err := c.GetSession(ctx, &sessionv1.GetSessionRequest{SessionId: id})
	require.NoError(t, err)
	require.Equal(t, sessionv1.SessionState_SESSION_STATE_DELETING, got.GetState())

	s.ingest.start(t)
	select {
	case err := <-deleted:
		require.NoError(t, err)
	case <-ctx.Done():
		t.Fatal("DeleteSession did not return after ingest came back")
	}
	for _, x := range r.of("DeleteSession") {
		d, ok := apierr.RetryDelay(x.Err)
		if client.Reason(x.Err) == client.ReasonDeletionPendingCleanup {
			require.True(t, ok, "RetryInfo")
			require.Equal(t, d, x.Delay, "the client waited what RetryInfo said")
		}
	}
	_, err = c.GetSession(ctx, &sessionv1.GetSessionRequest{SessionId: id})
	require.Equal(t, client.ReasonSessionNotFound, client.Reason(err))
	require.Empty(t, wrapperPIDs(t, sess.GetSandboxId()), "the wrapper is gone")
}

// TestCLIUsesTheInternalToken: against services that require the internal
// token, the CLI sends AGENTPLANE_INTERNAL_TOKEN; without it the refusal is
// one line and exit 2.
func TestCLIUsesTheInternalToken(t *testing.T) {
	s := startRestartable(t)
	sess := s.create(t, s.client(t), "/work/client-cli-token")
	get := []string{"session", "get", "--addr", s.addr, "--output", "json", sess.GetSessionId()}

	t.Setenv("AGENTPLANE_INTERNAL_TOKEN", "") // empty: none
	var out, errb bytes.Buffer
	require.Equal(t, 2, cli.Main(get, &out, &errb), "without the token")
	require.Regexp(t, `^agentplane session get: .*\[MISSING_CREDENTIALS\]\n$`, errb.String())

	t.Setenv("AGENTPLANE_INTERNAL_TOKEN", token)
	out.Reset()
	errb.Reset()
	require.Equal(t, 0, cli.Main(get, &out, &errb), "stderr: %s", errb.String())
	got := &sessionv1.Session{}
	require.NoError(t, protojson.Unmarshal(out.Bytes(), got))
	require.Equal(t, sess.GetSessionId(), got.GetSessionId())
}
